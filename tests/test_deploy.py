"""The launch recipes in docs/deploy/ rendered with real arguments: Kubernetes objects valid against the API's
schema, every `sgjax serve` command line parsed by sgjax's own CLI parser (a renamed flag fails here), the router's
by sglang-router's, and the Slurm script's shell syntax."""

import os
import re
import shlex
import shutil
import string
import subprocess

import pytest
import yaml

DEPLOY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "deploy")
SETTINGS = dict(
    name="sgjax-llama",
    image="registry.example.com/sgjax:1.0",
    model_path="/models/Llama-3.1-70B-Instruct",
    models_claim="models",
    nnodes=2,
    gpus_per_node=8,
    tp_size=16,
    replicas=4,
    time_limit="04:00:00",
)


def render(name: str, **overrides) -> str:
    with open(os.path.join(DEPLOY, name)) as f:
        return string.Template(f.read()).substitute({**SETTINGS, **overrides})


def serve_args(argv: list[str]):
    from sgjax.cli import build_parser

    assert argv[:2] == ["sgjax", "serve"], argv
    return build_parser().parse_args(argv[1:])


def containers(docs):
    return [
        c
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
        for c in d["spec"]["template"]["spec"]["containers"]
    ]


@pytest.mark.parametrize("name", ["k8s-tp-group.yaml", "k8s-workers-router.yaml"])
def test_kubernetes_objects_validate_against_the_api_schema(name):
    import kubernetes_validate

    docs = list(yaml.safe_load_all(render(name)))
    assert docs and all(d for d in docs)
    for doc in docs:
        kubernetes_validate.validate(doc, "1.30", strict=True)


def test_the_tp_group_runs_every_rank_with_sgjaxs_flags():
    docs = list(yaml.safe_load_all(render("k8s-tp-group.yaml")))
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet"]
    assert sts["spec"]["replicas"] == 2
    script = containers(docs)[0]["args"][0]
    # the pod ordinal (the shell's ${POD_NAME##*-}) is the node rank
    argv = shlex.split(script.replace("${POD_NAME##*-}", "1"))[1:]
    ns = serve_args(argv)
    assert (ns.nnodes, ns.node_rank, ns.tp_size) == (2, 1, 16)
    assert ns.dist_init_addr == "sgjax-llama-0.sgjax-llama:5000"


def test_the_workers_and_the_router_take_their_own_flags():
    from sglang_router.launch_router import parse_router_args

    docs = list(yaml.safe_load_all(render("k8s-workers-router.yaml")))
    worker, router = containers(docs)
    ns = serve_args(worker["command"] + worker["args"])
    assert ns.tp_size == 16 and ns.model_path == SETTINGS["model_path"]
    assert router["command"][-1] == "sglang_router.launch_router"
    args = parse_router_args(router["args"])
    assert args.service_discovery and args.policy == "cache_aware"
    assert args.selector == {"app": "sgjax-llama-worker"}


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_slurm_script_parses_and_runs_sgjax_with_its_flags(tmp_path):
    script = render("slurm-tp.sbatch")
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    assert re.search(r"^#SBATCH --nodes=2$", script, re.M)
    inner = re.search(r'bash -c "exec (sgjax serve .*?)"', script, re.S).group(1)
    inner = inner.replace("\\\n", " ").replace("\\$SLURM_NODEID", "1").replace("$head_node", "node-a")
    ns = serve_args(shlex.split(inner))
    assert (ns.nnodes, ns.node_rank, ns.dist_init_addr) == (2, 1, "node-a:5000")
