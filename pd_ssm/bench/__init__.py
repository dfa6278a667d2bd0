"""Benchmarks: `pd-ssm bench engine` (engine.py: whole-model steps, against the floors of
roofline.py) and `pd-ssm bench kernels` (kernels.py: each kernel), both against ceilings measured
in the same run."""
