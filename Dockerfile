# A paratrain image that every cluster engine can run (docs/get-started/clusters.md):
#   docker build -t REGISTRY/paratrain:TAG [--build-arg EXTRAS=dashboard,examples] .
#   paratrain launch --backend k8s --image REGISTRY/paratrain:TAG -w 2 -s 1 examples/digits.py
# Scripts run from /workspace (the examples are there); build FROM this image to add your own.
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
# torch from PyPI: its Linux wheels carry CUDA, so one image serves CPU and GPU nodes.
ARG TORCH_VERSION=2.13.0
ARG EXTRAS=dashboard
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY src ./src
RUN python -m venv /opt/paratrain \
    && /opt/paratrain/bin/pip install --no-cache-dir "torch==${TORCH_VERSION}" \
    && /opt/paratrain/bin/pip install --no-cache-dir ".[${EXTRAS}]"

FROM python:${PYTHON_VERSION}-slim
COPY --from=build /opt/paratrain /opt/paratrain
# Output reaches `kubectl logs` line by line; paratrain's and the venv's python come first on PATH.
ENV PATH=/opt/paratrain/bin:$PATH \
    PYTHONUNBUFFERED=1
RUN useradd --create-home --uid 1000 paratrain
WORKDIR /workspace
COPY --chown=1000:1000 examples ./examples
USER 1000
CMD ["paratrain", "--help"]
