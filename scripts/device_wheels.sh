#!/usr/bin/env bash
# The wheels scripts/device_check.sh installs on the GPU machine (Python 3.12, its own torch,
# no network): the notebook and kernel packages its image lacks, at the versions
# requirements.lock pins, and tabulate (torch.distributed.debug's server, lesson 13) and
# py-spy (lesson 09); papermill and its packages (the grader, scripts/device_trust.sh) and
# pytest-xdist and pytest-timeout. Then Debian's ip and tc for the virtual clusters.
#   Usage, here, in the repository's root: bash scripts/device_wheels.sh   (fills .whl/)
set -euo pipefail
names="asttokens comm debugpy decorator executing fastjsonschema ipykernel ipython
ipython_pygments_lexers ipywidgets jedi jsonschema jsonschema-specifications jupyter_client
jupyter_core jupyterlab_widgets matplotlib-inline nbclient nbformat parso pexpect platformdirs
prompt_toolkit ptyprocess pure_eval py-spy pyzmq referencing rpds-py stack-data tabulate tornado
traitlets wcwidth widgetsnbextension
papermill click entrypoints tenacity tqdm requests charset-normalizer idna urllib3 certifi PyYAML
pytest-xdist execnet pytest-timeout"
platforms=""
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_26_x86_64 \
         manylinux_2_27_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 \
         manylinux1_x86_64 manylinux_2_5_x86_64 any; do platforms="$platforms --platform $p"; done
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.whl/' >> .git/info/exclude; }
for name in $names; do
  pin=$(grep -i -E "^${name//[-_]/[-_]}==" requirements.lock) || { echo "device_wheels.sh: $name is not in requirements.lock" >&2; exit 1; }
  # shellcheck disable=SC2086 - one --platform per word
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $platforms -d .whl "$pin" 2>&1 | grep -v "^WARNING: Location" || true
done
bash scripts/iproute2_bundle.sh
ls .whl/*.whl | wc -l
