# One image for every pagestream role (worker, scheduler, frontend); compose.yaml picks the
# role with its command. It holds the runtime dependencies only (no test or benchmark
# extras), at the versions in constraints.txt, and runs as an unprivileged user. The default
# model (SmolLM2-135M-Instruct GGUF) is fetched and converted at build time, so nothing is
# downloaded at run time.
#
#   docker build -t pagestream .                                           # CPU torch
#   docker build --build-arg TORCH_VARIANT=cu128 -t pagestream:cu128 .     # CUDA 12.8 torch
#   docker run -p 50051:50051 -p 8000:8000 -e PAGESTREAM_API_KEY=... pagestream
#   docker run --gpus all -p 50051:50051 -p 8000:8000 -e PAGESTREAM_API_KEY=... pagestream:cu128
#
# The default command listens on 0.0.0.0, so it refuses to start without an API key
# (PAGESTREAM_API_KEY or --api-key) unless given --allow-unauthenticated.
FROM python:3.11-slim

# Which torch build: cpu, or a CUDA one (cu126, cu128, ...): the PyTorch wheel index it
# comes from. Its version is the one in constraints.txt either way.
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX=https://download.pytorch.org/whl/${TORCH_VARIANT}
# The user the roles run as; Kubernetes' runAsUser and fsGroup name the same ids.
ARG APP_UID=10001

# Triton compiles its kernels at run time with the system C compiler.
RUN apt-get update \
    && apt-get install -y --no-install-recommends make gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

RUN groupadd --gid ${APP_UID} pagestream \
    && useradd --uid ${APP_UID} --gid ${APP_UID} --create-home --shell /usr/sbin/nologin pagestream

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PAGESTREAM_CACHE=/opt/pagestream/cache \
    PATH=/app/.venv/bin:$PATH
WORKDIR /app

# Dependencies first (the slow layer), against placeholder packages: the editable install
# maps the package names to /app, where the real sources land in the next layer. The
# runtime install only: `make test`'s dev extras never enter the image. A CUDA torch wheel
# requires the exact triton it was built with (torch 2.13.0: triton 3.7.1), not the one the
# CPU pins name, so for a CUDA variant torch's own requirement picks triton.
COPY pyproject.toml Makefile README.md constraints.txt ./
RUN mkdir -p pagestream services pagestream_kernels \
    && touch pagestream/__init__.py services/__init__.py pagestream_kernels/__init__.py \
    && if [ "${TORCH_VARIANT}" != cpu ]; then sed -i '/^triton==/d' constraints.txt; fi \
    && make TORCH_INDEX=${TORCH_INDEX} .venv/.installed-runtime

COPY . .
# `make runtime` is idempotent: the venv is already there, so this builds the C++ kernels
# and fetches the default model's GGUF; then convert it once into the HF folder the roles
# load. The code and the venv stay root's (read-only to the roles); the cache is the
# user's, who writes converted models and takes the kernel build's lock there.
RUN make runtime \
    && python -c "from services.common.model_source import resolve_model; \
print(resolve_model('smollm2-135m-instruct'))" \
    && pagestream --help > /dev/null \
    && chown -R pagestream:pagestream "${PAGESTREAM_CACHE}"

USER ${APP_UID}:${APP_UID}

# 50051 gRPC Generation, 8000 OpenAI HTTP, 50061 worker, 50062 scheduler (engine core).
EXPOSE 50051 8000 50061 50062
CMD ["pagestream", "serve", "--host", "0.0.0.0"]
