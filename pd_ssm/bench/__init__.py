"""Benchmarks: `pd-ssm bench engine` (engine.py: whole-model steps) and `pd-ssm bench kernels`
(kernels.py: each kernel), both against ceilings measured in the same run."""
