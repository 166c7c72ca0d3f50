#!/bin/sh
# The course images' entry point. Without arguments: JupyterLab on the course, port 8888
# on every interface of the container (publish it on the host, e.g. -p 127.0.0.1:8888:8888),
# opening the course map. With arguments: runs them instead, e.g.
#   docker run --rm --init dist-course:cpu labutils launch -n 2 lessons/00_first_distributed_run/first_allreduce.py
set -eu

if [ "$#" -gt 0 ]; then
    exec "$@"
fi
exec jupyter lab --no-browser --ip=0.0.0.0 --ServerApp.port=8888 \
    --ServerApp.root_dir=/home/learner/course lessons/index.ipynb
