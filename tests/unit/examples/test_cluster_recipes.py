"""The cluster recipes' files, checked offline: the Kubernetes manifests against the Kubernetes schemas,
every environment variable a recipe sets against what the project reads, and the failure policies
against ``torchft_lite.cluster.exit_codes``."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest

from torchft_lite.cluster import exit_codes

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="skipped: kubernetes-validate is not installed (the dev extra has it)")
from kubernetes_validate import utils as kv_utils  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
KUBERNETES = REPO / "examples" / "kubernetes"
SLURM = REPO / "examples" / "slurm"
MANIFESTS = sorted(KUBERNETES.glob("*.yaml"))
# Where the project reads its settings: the packages and the example trainer the recipes run.
READERS = [*(REPO / "lighthouse").rglob("*.py"), *(REPO / "torchft_lite").rglob("*.py"),
           REPO / "examples" / "train_ddp.py"]


def resources() -> list[tuple[str, dict]]:
    return [(f"{path.name}:{r['kind']}/{r['metadata']['name']}", r)
            for path in MANIFESTS for r in kv_utils.resources_from_file(str(path))]


def containers(resource: dict) -> list[dict]:
    spec = resource.get("spec", {})
    pod = spec.get("template", {}).get("spec", {})
    return [*pod.get("containers", []), *pod.get("initContainers", [])]


def project_reads(name: str) -> bool:
    """Whether the project's code names the variable ``name`` as a string (how every setting is read)."""
    quoted = re.compile(rf"""["']{re.escape(name)}["']""")
    return any(quoted.search(path.read_text()) for path in READERS)


def test_there_are_manifests_for_the_lighthouse_the_secret_and_the_groups():
    kinds = {name.split(":")[1].split("/")[0] for name, _ in resources()}
    assert {"Deployment", "Service", "Secret", "Job", "PersistentVolumeClaim"} <= kinds


@pytest.mark.parametrize("name, resource", resources(), ids=[name for name, _ in resources()])
def test_every_manifest_validates_strictly_against_the_kubernetes_schema(name, resource):
    kubernetes_validate.validate(resource, kv_utils.latest_version(), strict=True)


def test_the_validation_is_live_a_spoiled_job_fails():
    job = copy.deepcopy(next(r for _, r in resources() if r["kind"] == "Job"))
    job["spec"]["completions"] = "four"
    job["spec"]["template"]["spec"]["containers"][0]["restartPolicyy"] = "Never"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, kv_utils.latest_version(), strict=True)


def test_every_environment_variable_the_manifests_set_is_one_the_project_reads():
    names = {env["name"] for _, r in resources() for c in containers(r) for env in c.get("env", [])}
    assert names, "the manifests set no environment variable"
    unread = sorted(name for name in names if not project_reads(name))
    assert not unread, f"set by the manifests but read by nothing in the project: {unread}"


def test_every_variable_the_slurm_scripts_export_is_one_the_project_reads():
    exported = set()
    for script in SLURM.glob("*.sbatch"):
        exported |= set(re.findall(r"^\s*export ([A-Z_][A-Z0-9_]*)", script.read_text(), re.MULTILINE))
    assert {"REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE", "TORCHFT_LITE_TOKEN_FILE"} <= exported
    unread = sorted(name for name in exported if not project_reads(name))
    assert not unread, f"exported by the Slurm scripts but read by nothing in the project: {unread}"


def test_a_made_up_variable_would_be_caught():
    assert not project_reads("TORCHFT_LITE_NO_SUCH_SETTING")
    assert project_reads("TORCHFT_LITE_HOSTNAME")


def _job() -> dict:
    return next(r for _, r in resources() if r["kind"] == "Job")


def test_the_pod_failure_policy_is_the_exit_code_table():
    rules = _job()["spec"]["podFailurePolicy"]["rules"]
    by_action: dict[str, set[int]] = {}
    for rule in rules:
        codes = rule.get("onExitCodes")
        if codes and codes["operator"] == "In":
            by_action.setdefault(rule["action"], set()).update(codes["values"])
    assert by_action["FailJob"] == {exit_codes.EXIT_CODE_DIVERGED, exit_codes.EXIT_CODE_FATAL}
    assert by_action["Ignore"] == {exit_codes.EXIT_CODE_PREEMPTED}
    assert any(rule["action"] == "Ignore" and rule.get("onPodConditions") for rule in rules)
    counted = next(r for r in rules if r["action"] == "Count")["onExitCodes"]
    assert counted["operator"] == "NotIn" and set(counted["values"]) == by_action["FailJob"] | by_action["Ignore"]
    assert _job()["spec"]["template"]["spec"]["restartPolicy"] == "Never"


def test_the_job_runs_one_pod_per_group_and_says_how_many_groups_there_are():
    job = _job()
    (trainer,) = job["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in trainer["env"]}
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == int(env["NUM_REPLICA_GROUPS"]["value"])
    assert "job-completion-index" in env["REPLICA_GROUP_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert trainer["command"][:3] == ["python", "-m", "torchft_lite.launch"]


def test_the_slurm_failure_rule_is_the_exit_code_table():
    script = (SLURM / "replica-groups.sbatch").read_text()
    not_requeued = re.search(r"^\s*([0-9|]+)\) echo .*not requeued", script, re.MULTILINE).group(1)
    assert {int(code) for code in not_requeued.split("|")} == {exit_codes.EXIT_CODE_DIVERGED,
                                                                exit_codes.EXIT_CODE_FATAL}


def test_no_recipe_ships_a_token():
    (secret,) = [r for _, r in resources() if r["kind"] == "Secret"]
    assert secret["stringData"]["token"] == ""
    for _, resource in resources():
        for container in containers(resource):
            assert not any(e["name"] == "TORCHFT_LITE_TOKEN" for e in container.get("env", []))
    for script in SLURM.glob("*.sbatch"):
        assert "TORCHFT_LITE_TOKEN=" not in script.read_text()
