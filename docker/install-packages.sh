#!/bin/sh
# Installs the course's Python packages into an image, as `make lab` does into .venv:
# torch $TORCH_VERSION from the PyTorch index $TORCH_INDEX_URL (the CPU or the CUDA build
# of the same release), then every pin of requirements.lock, then labutils itself.
# Run from the course folder, where requirements.lock and pyproject.toml are.
set -eu

locked=$(sed -n 's/^torch==\([^ ;#]*\).*$/\1/p' requirements.lock)
if [ "$locked" != "$TORCH_VERSION" ]; then
    echo "install-packages.sh: TORCH_VERSION=$TORCH_VERSION but requirements.lock pins torch==$locked;" \
         "set ARG TORCH_VERSION in the Dockerfile to the lock's version" >&2
    exit 1
fi

# torch first, from PyTorch's own index: its local version (+cpu, +cu130) still
# satisfies the lock's torch==$TORCH_VERSION, so the next step keeps it.
python -m pip install --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"
python -m pip install -r requirements.lock
python -m pip install --no-deps .
python -c "import torch, labutils; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
