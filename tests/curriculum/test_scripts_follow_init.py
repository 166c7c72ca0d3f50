"""Course scripts run where init() puts them, on a machine with or without a GPU.

init() picks gloo on the CPU when a machine has fewer GPUs than ranks. torch's own defaults
do not know that: `fully_shard` without a mesh builds one on the machine's accelerator, and
on a one-GPU machine every rank but 0 then fails in `cuda.set_device` (lesson 12's
anatomy.py did, on an H200). So every mesh a course script builds names init()'s device.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p for folder in ("lessons", "labs", "solutions") for p in (ROOT / folder).rglob("*.py")
                 if "runs" not in p.relative_to(ROOT).parts)


def calls(tree: ast.AST, name: str):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called == name:
                yield node


def offences(source: str) -> list[str]:
    tree = ast.parse(source)
    found = [f"line {c.lineno}: fully_shard without mesh=" for c in calls(tree, "fully_shard")
             if not any(k.arg == "mesh" for k in c.keywords)]
    found += [f"line {c.lineno}: init_device_mesh on a device named in the script"
              for c in calls(tree, "init_device_mesh") if c.args and isinstance(c.args[0], ast.Constant)]
    return found


def test_the_rule_finds_what_failed_on_the_gpu_machine():
    assert offences("for b in m:\n    fully_shard(b)\n") == ["line 2: fully_shard without mesh="]
    assert offences("mesh = init_device_mesh('cuda', (4,))") == [
        "line 1: init_device_mesh on a device named in the script"]
    assert offences("mesh = init_device_mesh(device.type, (4,))\nfully_shard(m, mesh=mesh)") == []


def test_every_mesh_names_the_device_init_chose():
    found = [f"{script.relative_to(ROOT)} {offence}" for script in SCRIPTS
             for offence in offences(script.read_text())]
    assert len(SCRIPTS) > 100 and not found, (
        "build each mesh with init_device_mesh(device.type, ...), device from init(), and pass it: "
        + "; ".join(found))
