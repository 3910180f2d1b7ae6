# One image for every role; compose.yaml picks the role with the subcommand.
# GPU workers need a CUDA build of torch (the PyPI default on Linux x86_64); for a CPU-only image:
#   docker build --build-arg TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cpu" .
FROM python:3.11-slim

ARG TORCH_SPEC="torch>=2.4"
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app

# A C and C++ compiler: `--compile` (inductor) and the CPU decode-attention kernel are built with it at start-up.
RUN apt-get update && apt-get install -y --no-install-recommends gcc g++ libc6-dev && rm -rf /var/lib/apt/lists/*
RUN pip install $TORCH_SPEC
COPY pyproject.toml README.md ./
COPY loraserve loraserve
COPY gateway gateway
COPY scheduler scheduler
COPY adapter_store adapter_store
COPY worker worker
COPY launcher launcher
COPY kernels kernels
COPY bench bench
COPY demo demo
COPY proto proto
RUN pip install ".[s3]"

# Adapters to register by path go under /adapters (mounted read-only); the store keeps its own in /data;
# /keys holds the internal keys (compose's internal-keys volume).
RUN useradd --create-home loraserve && mkdir -p /adapters /data /keys && chown loraserve /adapters /data /keys
USER loraserve
ENTRYPOINT ["loraserve"]
CMD ["--help"]
