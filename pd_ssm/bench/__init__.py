"""Benchmarks: `pd-ssm bench engine` (engine.py: whole-model steps, against the floors of
roofline.py) and `pd-ssm bench kernels` (kernels.py: each kernel), both against ceilings measured
in the same run; `pd-ssm bench transfer` (transfer*.py: the connectors against raw sends); and
`pd-ssm bench serve` (serving.py: a workload.py workload against a running OpenAI-compatible server
through client.py, summarized by metrics.py)."""
