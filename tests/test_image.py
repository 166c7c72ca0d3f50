"""The learner's images, CPU and CUDA, built for real with podman and tried inside
(make test-image; `-k cpu` or `-k cuda` for one).

docker/build-local.sh builds it from the learner copy (scripts/learner_copy.py) on this
machine: no Docker engine, no registry, a Debian base made with debootstrap. It then runs
tries in containers of the image: no instructor material in the image, lesson 00 under
nbval as the image's user, lab 01's solution graded by `labutils grade` as root and as
the image's user. This test runs the script and reads what each try printed. It
downloads Debian and Python packages and takes minutes, so `make test` leaves it out
(marker `image`).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
from helpers import REPO

pytestmark = [pytest.mark.image, pytest.mark.timeout(3600)]  # the build: minutes


@pytest.fixture(scope="module", params=["cpu", "cuda"])
def build(request, tmp_path_factory):
    """(flavor, the finished build.sh process) for docker/Dockerfile.<flavor>."""
    flavor = request.param
    if os.geteuid() != 0:
        pytest.skip("building the image needs root here (podman with runc, debootstrap)")
    if shutil.which("apt-get") is None and shutil.which("podman") is None:
        pytest.skip("neither podman nor apt-get to install it: not a Debian machine")
    work = tmp_path_factory.mktemp("image")
    env = {**os.environ, "WORK": str(work), "FLAVOR": flavor,
           "IMAGE": f"localhost/dist-course-test:{flavor}"}
    done = subprocess.run([str(REPO / "docker" / "build-local.sh")], capture_output=True, text=True,
                          env=env, timeout=3600)
    print(done.stdout[-6000:], done.stderr[-3000:])
    return flavor, done


def test_the_image_builds_and_every_try_passes(build):
    flavor, build = build
    assert build.returncode == 0, build.stderr[-3000:]
    assert f"[image] localhost/dist-course-test:{flavor} built and tried" in build.stdout


def test_the_image_holds_the_torch_build_of_its_flavor(build):
    flavor, build = build
    found = re.search(r"\[image\]   torch (\S+) CUDA (\S+) GPUs (\d+)", build.stdout)
    assert found, build.stdout[-3000:]
    version, cuda, _ = found.groups()
    assert version.startswith("2.13.0")
    assert (cuda == "None") == (flavor == "cpu"), found.group(0)
    if flavor == "cuda":
        assert cuda.startswith("13.")


def test_lesson_00_passes_nbval_inside(build):
    build = build[1]
    after = build.stdout.split("lesson 00 under nbval, inside", 1)[1]
    assert re.search(r"\b(\d+) passed\b", after) and " failed" not in after.split("[image]", 2)[1]


@pytest.mark.parametrize("uid", [0, 1000])
def test_the_solution_of_lab_01_passes_when_graded_inside(build, uid):
    """As root (an autograder) and as the image's user (a learner grading their copy)."""
    build = build[1]
    after = build.stdout.split(f"the solution graded inside, as uid {uid}", 1)[1]
    lines = after.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("submission,score,max_score,"))
    name, score, max_score, _, passed, notebook = lines[header + 1].split(",")[:6]
    assert (name, passed, notebook) == ("submission", "yes", "completed") and score == max_score


def test_no_instructor_material_was_found(build):
    build = build[1]
    after = build.stdout.split("no instructor material in the image", 1)[1]
    assert "found:" not in after.split("[image]", 2)[1]
