#!/usr/bin/env bash
# Container smoke test: the real Dockerfile built on a local Debian base with podman, the default job (demo run
# logs -> pairs -> 4-bit LoRA DPO, 2 steps) run in it through the kit's launcher and Makefile against podman's
# Docker-compatible socket, then `make prune`.
#
#     .ci/container-smoke.sh        # or: make test-container      (root, Debian/Ubuntu host with apt)
#
# Checks: the tarball lands in artifacts/ owned by the caller and `sha256sum -c` passes; the same steps in .venv
# (make train RUNNER=local, the same pairs) give a byte-identical adapter when torch is the same build; the input
# mount is read-only; `check --require_gpu` fails without a GPU; the launcher's engine tests pass; `make prune`
# removes the kit's leftovers (a superseded kit image, a stopped kit container) and nothing else (a foreign image and
# container made before, and the base, survive). Exit 77 when podman cannot be set up here (CI: "skipped").
# Set-up is idempotent: packages, /etc/containers/containers.conf and the base image are made only if missing.
# The kit image (IMAGE:TAG) is kept for the next run; `podman rmi` it, or `make prune` after a code change.
set -euo pipefail
cd "$(dirname "$0")/.."

BASE=localhost/debian-base:bookworm
WHEEL=${TORCH_WHEEL:-/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl}  # Debian 12: Python 3.11
RUN=ci-container
STEPS="--max_steps 2 --max_length 96 --per_device_train_batch_size 2 --lora_r 4 --probes= --eval_samples 1 --eval_max_new_tokens 16"  # in the image and .venv; probes and the checker's samples cut short: the adapter is saved before them
SOCK=/run/dpo-kit-smoke-$$.sock
export DOCKER_HOST=unix://$SOCK
BUILD=(BASE_IMAGE=$BASE TORCH_VARIANT=cpu EXTRAS=none)
T0=$SECONDS
step() { echo; echo "=== [$((SECONDS - T0))s] $*"; }
skip() { echo "container smoke SKIPPED: $*" >&2; exit 77; }
fail() { echo "container smoke FAILED: $*" >&2; exit 1; }

step "set-up: podman, buildah, debootstrap, runc"
need=(); for tool in podman buildah debootstrap runc; do command -v "$tool" >/dev/null || need+=("$tool"); done
if ((${#need[@]})); then
  [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null || skip "needs ${need[*]}, and installing them needs root and apt-get"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}" >/dev/null; } \
    || skip "apt-get install ${need[*]} failed"
fi
command -v docker >/dev/null || skip "no docker CLI (the Docker-compatible client the checks use)"
if [[ ! -f /etc/containers/containers.conf ]]; then
  # podman's defaults fail here: nofile/nproc 1048576 not permitted; crun refuses hybrid cgroups -> runc
  mkdir -p /etc/containers && cat > /etc/containers/containers.conf <<'CONF'
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
CONF
fi
podman info >/dev/null 2>&1 || skip "podman is installed but does not work here: $(podman info 2>&1 | tail -1)"

step "base image $BASE (debootstrap, only when missing)"
if ! podman image exists $BASE; then
  # The host's Debian mirror: sources.list or deb822 .sources files (disabled and third-party ones ignored; a
  # missing sources.list is normal on Debian 12 and must not stop the script under pipefail)
  mirror=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null \
           | grep -oE '^(URIs:|deb) +https?://[^ ]+' | awk '{print $2}' | grep -E '/debian/?$' | head -1 || true)
  rootfs=$(mktemp -d)
  debootstrap --variant=minbase bookworm "$rootfs" "${mirror:-http://deb.debian.org/debian}" >/dev/null \
    || skip "debootstrap could not make a base image"
  chroot "$rootfs" apt-get clean && rm -rf "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" --numeric-owner -c . | podman import --change 'CMD ["/bin/bash"]' - $BASE >/dev/null
  rm -rf "$rootfs"
fi

step "podman's Docker API on $DOCKER_HOST"
podman system service --time=0 "$DOCKER_HOST" & SERVICE=$!
staged=()
cleanup() {
  docker rm -f dpo-kit-smoke-foreign dpo-kit-smoke-kitleft >/dev/null 2>&1 || true
  docker rmi -f localhost/dpo-kit-smoke-foreign:1 dpo-kit:smoke-old >/dev/null 2>&1 || true
  kill "$SERVICE" 2>/dev/null && wait "$SERVICE" 2>/dev/null || true
  rm -rf "$SOCK" "${staged[@]}"
  echo "container smoke: $((SECONDS - T0))s in all"
}
trap cleanup EXIT
for _ in $(seq 50); do docker version >/dev/null 2>&1 && break; sleep 0.2; done
docker version --format 'engine: {{.Server.Version}} (API {{.Server.APIVersion}})' || fail "podman's socket does not answer"

step "stage the host's CA certificates (certs/) and the CPU torch wheel (wheels/) in the build context"
[[ -f $WHEEL ]] || skip "no CPU torch wheel at $WHEEL (TORCH_WHEEL=...)"
for crt in /usr/local/share/ca-certificates/*.crt; do
  [[ -f $crt ]] && cp "$crt" "certs/smoke-$(basename "$crt")" && staged+=("certs/smoke-$(basename "$crt")")
done
if [[ ! -f wheels/$(basename "$WHEEL") ]]; then
  ln "$WHEEL" wheels/ 2>/dev/null || cp "$WHEEL" wheels/
  staged+=("wheels/$(basename "$WHEEL")")
fi

step "leftovers to prune, and foreign things that must survive"
docker rm -f dpo-kit-smoke-foreign dpo-kit-smoke-kitleft >/dev/null 2>&1 || true
printf 'FROM %s\nLABEL dpo-kit=1\n' $BASE | docker build -q -t dpo-kit:smoke-old - >/dev/null  # a superseded kit image
printf 'FROM %s\nLABEL smoke=foreign\n' $BASE | docker build -q -t localhost/dpo-kit-smoke-foreign:1 - >/dev/null
docker run --name dpo-kit-smoke-kitleft --label dpo-kit=1 $BASE true                  # a stopped kit container
docker run --name dpo-kit-smoke-foreign $BASE true                                    # a stopped foreign one

# The tag hashes the code: fix it now, so an edit during the run does not make a second image.
TAG=$(python3 -c 'from dpokit.apps import launcher; print(launcher.tag_for(launcher.LaunchConfig(base_image="'$BASE'", torch_variant="cpu", extras="none")))')
BUILD+=(TAG=$TAG)
image=dpo-kit:$TAG

step "make build ${BUILD[*]}"
t=$SECONDS; make build "${BUILD[@]}"; echo "build: $((SECONDS - t))s"
echo "image size: $(docker image inspect --format '{{.Size}}' "$image" | awk '{printf "%.2f GB", $1 / 1e9}'); its layers:"
docker history --format '{{.Size}}\t{{.CreatedBy}}' "$image" | grep -v '^0B' | cut -c1-110 || true

step "make train RUNNER=docker (demo run logs -> pairs -> 2 DPO steps) RUN=$RUN"
rm -rf artifacts/$RUN artifacts/$RUN.partial artifacts/$RUN.tar.gz artifacts/$RUN.tar.gz.sha256
t=$SECONDS
# ROUNDS=0: one training (make train's round would add a second stage and its attempts; the .venv check below trains
# once on the same pairs). The round's command in the container is tests/test_launcher.py's.
make train RUNNER=docker ROUNDS=0 "${BUILD[@]}" RUN=$RUN PRUNE=0 ARGS="$STEPS"
echo "train: $((SECONDS - t))s"
tarball=artifacts/$RUN.tar.gz
[[ -f $tarball ]] || fail "$tarball not on the host"
[[ $(stat -c %u:%g "$tarball") == "$(id -u):$(id -g)" ]] || fail "$tarball is owned by $(stat -c %u:%g "$tarball"), not the caller $(id -u):$(id -g)"
[[ ! -e artifacts/$RUN.partial ]] || fail "artifacts/$RUN.partial left behind"
(cd artifacts && sha256sum -c "$RUN.tar.gz.sha256") || fail "sha256sum -c failed"
[[ -z $(docker ps -aq --filter label=dpo-kit.action=train) ]] || fail "the train container was not removed"

step "the same steps in .venv (make train RUNNER=local RUN=$RUN-venv) on the same pairs: the same adapter?"
if [[ -x .venv/bin/python ]]; then
  rm -rf artifacts/$RUN-venv artifacts/$RUN-venv.partial artifacts/$RUN-venv.tar.gz artifacts/$RUN-venv.tar.gz.sha256
  t=$SECONDS
  make train RUNNER=local RUN=$RUN-venv DATA=artifacts/pairs/runs.pairs.jsonl ARGS="$STEPS"
  echo "train in .venv: $((SECONDS - t))s"
  in_image=$(sha256sum < artifacts/$RUN/adapter_model.safetensors | cut -d' ' -f1)
  in_venv=$(sha256sum < artifacts/$RUN-venv/adapter_model.safetensors | cut -d' ' -f1)
  echo "adapter_model.safetensors sha256: image $in_image, .venv $in_venv"
  # Equal when both run the same torch build: every other package is the same wheel from the lock, the model is
  # converted by the same code, and both run on this CPU (same ISA dispatch, same thread count). Python (3.11.2
  # in the image, whatever .venv has) does not enter the arithmetic. A different torch build rounds differently.
  venv_torch=$(.venv/bin/python -c 'import torch; print(torch.__version__)')
  image_torch=$(basename "$WHEEL" | cut -d- -f2)
  if [[ $in_image == "$in_venv" ]]; then echo "ok: the same adapter (torch: image $image_torch, .venv $venv_torch)"
  elif [[ $venv_torch != "$image_torch" ]]; then
    echo "differ, as expected: the image has torch $image_torch ($WHEEL), .venv has torch $venv_torch"
  else fail "the image and .venv trained different adapters with the same torch $venv_torch: compare pip list," \
    "the models/ sha256 and torch.backends.cpu.get_cpu_capability() in both"; fi
else echo "skipped: no .venv (make venv) to train in"; fi

L=(.venv-launcher/bin/python launcher.py --tag "$TAG")
step "the input mount is read-only"
if out=$("${L[@]}" shell --data artifacts/pairs/runs.pairs.jsonl -- -c 'echo x >> /data/runs.pairs.jsonl' 2>&1); then
  fail "writing to the mounted data succeeded"
fi
grep -q "Read-only file system" <<<"$out" || fail "unexpected error writing to /data: $out"
echo "ok: $(grep "Read-only" <<<"$out" | tail -1)"

step "Triton's build needs in the image: a C compiler and Python.h, used as Triton uses them"
# Triton's first kernel builds its launcher: gcc -shared -fPIC against Python.h, then imports the module
# (triton/runtime/build.py). The same here, as the image's non-root user in a scratch directory; the kernel itself
# compiles only on a GPU (bench/gpu.sh), and the CPU image has no Triton.
docker run --rm --entrypoint bash "$image" -c 'set -e; gcc --version | head -1; cd "$(mktemp -d)"
  inc=$(python -c "import sysconfig; print(sysconfig.get_paths()[\"include\"])"); ls "$inc/Python.h"
  printf "%s\n" "#include <Python.h>" "static PyModuleDef m = {PyModuleDef_HEAD_INIT, \"launcher\", NULL, -1, NULL};" \
    "PyMODINIT_FUNC PyInit_launcher(void) { return PyModule_Create(&m); }" > launcher.c
  so=launcher$(python -c "import sysconfig; print(sysconfig.get_config_var(\"EXT_SUFFIX\"))")
  gcc launcher.c -O3 -shared -fPIC -Wno-psabi -o "$so" -I "$inc"
  python -c "import launcher; print(\"built and imported\", launcher.__file__)"' \
  || fail "the image cannot build a C extension against its Python.h (Triton cannot build its launcher)"
# and a Triton kernel through the pre-flight's own test: the CPU image has no Triton (no use off a GPU), so the
# lock's version goes into a scratch directory of a throwaway container, and the kernel runs under its interpreter
triton=$(grep -E '^triton==' requirements.txt)
out=$(docker run --rm --entrypoint bash "$image" -c "pip install -q --target /tmp/t $triton >/dev/null && \
  cd /opt/kit && PYTHONPATH=/tmp/t python entrypoint.py check 2>&1" 2>&1) || true
grep -q "a one-kernel test ran under Triton's interpreter" <<<"$out" || fail "no Triton kernel ran in the image: $out"
echo "ok: $(grep -o "Triton [0-9.]*: a one-kernel test ran under Triton's interpreter[^.]*" <<<"$out")"

step "hostile answers in the image's sandbox, as the caller and as the image's own non-root user"
# What a GPU user's `docker run` gives the kit: the runtime's default seccomp and capabilities. sandbox.py --modes
# records which isolation runs there; then one answer writes outside its workspace and one deletes /artifacts.
sentinel=artifacts/.sandbox-smoke-$$
echo keep > "$sentinel"
for user in "$(id -u):$(id -g)" 1000:1000; do
  out=$(docker run --rm --user "$user" -v "$PWD/artifacts:/artifacts" --entrypoint bash "$image" -c '
    cd /opt/kit && python sandbox.py --modes | tr -d "\n"; echo
    printf "%s\n" "import os" "for t in [\"/tmp/escape\", \"/artifacts/escape\", \"/home/kit/escape\", \"/dev/shm/escape\"]:" \
      "    try:" "        open(t, \"w\").write(\"x\")" "    except OSError as e:" "        print(type(e).__name__)" > /tmp/write.py
    printf "%s\n" "import shutil" "shutil.rmtree(\"/artifacts\", ignore_errors=True)" "print(\"tried\")" > /tmp/rm.py
    for a in /tmp/write.py /tmp/rm.py; do python sandbox.py $a | python -c "import json,sys; r=json.load(sys.stdin); print(r[\"isolation\"], \"landlock\", r[\"landlock\"], r[\"bounds\"], repr(r[\"stdout\"][:80]))"; done
    ls /tmp/escape /home/kit/escape /dev/shm/escape 2>/dev/null && echo ESCAPED || true' 2>&1) || fail "the sandbox did not run in the image as $user: $out"
  echo "as $user: $out"
  grep -q ESCAPED <<<"$out" && fail "an answer wrote outside its workspace in the image (as $user)"
  [[ -e artifacts/escape ]] && fail "an answer wrote into /artifacts (as $user)"
  [[ $(cat "$sentinel" 2>/dev/null) == keep ]] || fail "an answer deleted /artifacts (as $user)"
done
rm -f "$sentinel"
echo "ok: nothing written outside, /artifacts intact"

step "the image's sandbox under Docker's own default seccomp profile, then under the kit's (what make train passes)"
# Docker's default profile keeps namespaces and mounts from a container without CAP_SYS_ADMIN: bubblewrap cannot
# start and the sandbox falls to limits mode, which the pre-flight must say. Podman takes the same JSON; its own
# default profile is laxer (the steps above ran bwrap). Docker's profile comes from Debian's package of Docker's
# source, as the image's build takes it (not kept in the repository).
profiles=$(mktemp -d); staged+=("$profiles")
(cd "$profiles" && apt-get download golang-github-docker-docker-dev >/dev/null 2>&1) \
  || fail "apt-get download golang-github-docker-docker-dev failed (Docker's default seccomp profile)"
dpkg-deb --fsys-tarfile "$profiles"/golang-github-docker-docker-dev_*.deb \
  | tar -xO --wildcards '*/profiles/seccomp/default.json' > "$profiles/docker-default.json"
docker run --rm --entrypoint cat "$image" /opt/kit/seccomp.json > "$profiles/kit.json"
echo "the kit's profile adds to Docker's: $(python3 dpokit/sandbox/seccomp_profile.py --added "$profiles/kit.json" "$profiles/docker-default.json")"
for side in docker-default:limits kit:bwrap; do
  name=${side%%:*} want=${side##*:}
  for user in "$(id -u):$(id -g)" 1000:1000; do
    out=$(podman run --rm --user "$user" --security-opt "seccomp=$profiles/$name.json" --entrypoint bash "$image" -c '
      cd /opt/kit && python sandbox.py --modes | python -c "import json,sys; print(\"mode:\", json.load(sys.stdin)[\"default\"])"
      python entrypoint.py check 2>&1 | grep -i "sandbox"
      printf "%s\n" "import os, shutil" "shutil.rmtree(\"/home/mlops/runs\")" > /tmp/wipe.py
      python checker.py /tmp/wipe.py --host "Host gpu-9, Ubuntu 22.04, user mlops" | python -c "import json,sys; r=json.load(sys.stdin); print(\"checker:\", r[\"isolation\"], r[\"outcome\"])"' 2>&1) \
      || fail "the sandbox did not run in the image under $name's profile as $user: $out"
    echo "$name profile, as $user:"; sed 's/^/  /' <<<"$out"
    grep -q "^mode: $want$" <<<"$out" || fail "under $name's profile as $user the sandbox ran $(grep ^mode: <<<"$out"), not $want"
    if [[ $want == limits ]]; then
      grep -q "SANDBOX IN LIMITS MODE" <<<"$out" || fail "the pre-flight did not warn of limits mode under $name's profile"
      grep -q "checker: limits unscorable" <<<"$out" || fail "limits mode scored an answer at a host path it cannot plant"
    else
      grep -q "sandbox: model-written code runs in bwrap mode" <<<"$out" || fail "the pre-flight did not say bwrap"
      grep -q "checker: bwrap broke" <<<"$out" || fail "bwrap mode did not score the wipe of a kept run directory as broke"
    fi
  done
done
echo "ok: Docker's default profile -> limits (said, answers at host paths unscorable); the kit's -> bwrap"

step "entrypoint.py check --require_gpu fails without a GPU"
if "${L[@]}" check -- --require_gpu; then fail "check --require_gpu passed on a machine without a GPU"; fi

step "make prune: the kit's leftovers go, nothing else"
make prune "${BUILD[@]}"
docker image inspect dpo-kit:smoke-old >/dev/null 2>&1 && fail "the superseded kit image survived make prune"
docker container inspect dpo-kit-smoke-kitleft >/dev/null 2>&1 && fail "the stopped kit container survived make prune"
for keep in $BASE localhost/dpo-kit-smoke-foreign:1 "$image"; do
  docker image inspect "$keep" >/dev/null 2>&1 || fail "make prune removed $keep"
done
docker container inspect dpo-kit-smoke-foreign >/dev/null 2>&1 || fail "make prune removed a foreign container"
echo "ok: kept $BASE, the foreign image and container, and the current $image"
step "the launcher's engine tests"
if [[ -x .venv/bin/python ]]; then .venv/bin/python -m pytest -q tests/test_launcher.py
else echo "skipped: no .venv (make venv) to run pytest in"; fi
echo; echo "container smoke PASSED"
