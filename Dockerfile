# One image for every pagestream role (worker, scheduler, frontend); compose.yaml picks the
# role with its command. The default model (SmolLM2-135M-Instruct GGUF) is fetched at build
# time by `make setup` and converted once, so nothing is downloaded at run time.
#
#   docker build -t pagestream .
#   docker run --gpus all -p 50051:50051 -p 8000:8000 pagestream
FROM python:3.11-slim

# Triton compiles its kernels at run time with the system C compiler.
RUN apt-get update \
    && apt-get install -y --no-install-recommends make gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PAGESTREAM_CACHE=/opt/pagestream/cache \
    PATH=/app/.venv/bin:$PATH
WORKDIR /app

# Dependencies first (the slow layer), against placeholder packages: the editable install
# maps the package names to /app, where the real sources land in the next layer.
COPY pyproject.toml Makefile README.md constraints.txt ./
RUN mkdir -p pagestream services pagestream_kernels \
    && touch pagestream/__init__.py services/__init__.py pagestream_kernels/__init__.py \
    && make .venv/.installed

COPY . .
# `make setup` is idempotent: the venv is already there, so this fetches the default model's
# GGUF; then convert it once into the HF folder the roles load.
RUN make setup \
    && python -c "from services.common.model_source import resolve_model; \
print(resolve_model('smollm2-135m-instruct'))" \
    && pagestream --help > /dev/null

# 50051 gRPC Generation, 8000 OpenAI HTTP, 50061 worker, 50062 scheduler (engine core).
EXPOSE 50051 8000 50061 50062
CMD ["pagestream", "serve", "--host", "0.0.0.0"]
