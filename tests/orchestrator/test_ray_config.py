"""The Ray launcher's configuration, without a cluster: deploy/cluster.yaml against Ray's own schema
and against `pd-ssm serve`'s flags, the bundles workers ask for, and the errors of bad flags."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

from pd_ssm.cli import main
from pd_ssm.orchestrator.launcher import LaunchError
from pd_ssm.orchestrator.local import LocalDeployment
from pd_ssm.orchestrator.serve_cli import add_serve_parser

pytest.importorskip("ray", reason="Ray is not installed here (pip install 'pd-ssm[ray]')")
yaml = pytest.importorskip("yaml", reason="PyYAML comes with Ray; not installed here")

from pd_ssm.orchestrator.ray import DECODE_RESOURCE, PREFILL_RESOURCE, RayLauncher, RayOptions, bundle_for  # noqa: E402

CLUSTER_YAML = Path(__file__).resolve().parents[2] / "deploy" / "cluster.yaml"


def _cluster() -> dict[str, Any]:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def _serve_args(config: dict[str, Any]) -> argparse.Namespace:
    """The `pd-ssm serve` the head starts, parsed by pd-ssm's own parser."""
    lines = [c for c in config["head_start_ray_commands"] if "pd-ssm serve" in c]
    assert len(lines) == 1, lines
    words = shlex.split(lines[0])
    start = next(i for i, w in enumerate(words) if w.endswith("pd-ssm")) + 1
    end = words.index(">") if ">" in words else len(words)
    p = argparse.ArgumentParser()
    add_serve_parser(p.add_subparsers(dest="command"))
    return p.parse_args(words[start:end])


def test_cluster_yaml_passes_rays_schema() -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(_cluster()))


def test_cluster_yaml_node_types_fit_the_serve_command() -> None:
    config = _cluster()
    args = _serve_args(config)
    assert args.ray and args.ray_role_resources and args.disagg and args.device == "cuda"
    types = config["available_node_types"]
    head = config["head_node_type"]
    for resource, wanted in ((PREFILL_RESOURCE, args.num_prefill), (DECODE_RESOURCE, args.num_decode)):
        holders = [t for name, t in types.items() if name != head and resource in t.get("resources", {})]
        assert holders, f"no node type has the {resource} resource"
        most = sum(t["resources"][resource] * t["max_workers"] for t in holders)
        assert wanted <= most, f"{wanted} workers want {resource}; the cluster can have {most}"
        assert all(t["min_workers"] >= 1 for t in holders)
    # every node gets this checkout, and the serve command finds pd-ssm where setup installed it
    assert "." in config["file_mounts"].values()
    assert any("pip install" in c and "[ray]" in c for c in config["setup_commands"])


def _dep(**kw: Any) -> LocalDeployment:
    return LocalDeployment(model_dir="m", served_model_name="m", **kw)


def test_bundles_ask_for_cpus_the_gpu_and_the_role() -> None:
    opts = RayOptions(cpus_per_worker=2.0)
    assert bundle_for(_dep(), opts, "w0") == {"CPU": 2.0}
    assert bundle_for(_dep(device="cuda"), opts, "w1") == {"CPU": 2.0, "GPU": 1.0}
    roles = RayOptions(role_resources=True)
    disagg = _dep(disagg=True, device="cuda")
    assert bundle_for(disagg, roles, "p0") == {"CPU": 1.0, "GPU": 1.0, PREFILL_RESOURCE: 1.0}
    assert bundle_for(disagg, roles, "d0.2") == {"CPU": 1.0, "GPU": 1.0, DECODE_RESOURCE: 1.0}
    assert bundle_for(disagg, RayOptions(), "d0") == {"CPU": 1.0, "GPU": 1.0}
    assert bundle_for(_dep(), roles, "w0") == {"CPU": 1.0}  # colocated workers have no role to ask for


@pytest.mark.parametrize(("kw", "flag"), [({"strategy": "TIGHT"}, "--ray-placement-strategy"),
                                          ({"cpus_per_worker": 0.0}, "--ray-cpus-per-worker"),
                                          ({"max_restarts": -1}, "--ray-max-restarts"),
                                          ({"placement_timeout": 0.0}, "--ray-placement-timeout")])
def test_bad_ray_options_name_their_flag(kw: dict[str, Any], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        RayOptions(**kw)


def test_gpus_do_not_go_with_ray() -> None:
    with pytest.raises(ValueError, match="--gpus"):
        RayLauncher(_dep(device="cuda", gpus=[0]), RayOptions())


def test_without_ray_the_launch_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(LaunchError, match=r"pd-ssm\[ray\]"):
        RayLauncher(_dep(), RayOptions())


def test_serve_rejects_a_bad_ray_flag_before_starting_anything(default_model: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", str(default_model), "--ray", "--ray-placement-strategy", "TIGHT"]) == 2
    assert "--ray-placement-strategy must be one of PACK" in capsys.readouterr().err
