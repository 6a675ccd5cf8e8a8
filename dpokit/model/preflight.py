"""Pre-flight: can this machine run the training? Checked before anything heavy loads; each problem is one
sentence saying what to do.

    python preflight.py [--require_gpu] [--allow_cpu] [--nproc N] [--output_dir DIR]   # = entrypoint.py check
    python entrypoint.py check --require_gpu --output_dir /artifacts    # what `launcher.py check --gpus all` runs

train_dpo.py runs it first (a failure stops the run with exit status 1 before the model loads), and the launcher
reads the host's driver with it before `docker run`. In order: an NVIDIA GPU is visible (nvidia-smi) and PyTorch
can use it; the driver is new enough for the CUDA PyTorch was built for; the wheels have kernels for the GPU's
compute capability; MIG; /dev/shm; the output and cache directories are writable by this uid; Triton's C compiler
and Python.h, then a one-kernel Triton test. On a machine with an NVIDIA GPU, training on the CPU needs --allow_cpu.

The decisions are pure functions of the facts gathered (`Facts`: nvidia-smi's text, torch.version.cuda, ...),
tested with canned nvidia-smi outputs; only `gather`, `read_nvidia_smi` and `triton_smoke` look at the machine.
Standard library at import, so the launcher's host (no torch) uses it too.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from dpokit.core import kit, ranks
from dpokit.sandbox import sandbox
from dpokit.core.kit import field

EXIT_FAILED = 1  # the machine cannot run this (2 stays a mistake in the options)
SHM_MIN = 1 << 30  # bytes of /dev/shm: Docker's default 64 MB is too little for NCCL between processes
PROC_DRIVER = "/proc/driver/nvidia/version"  # the kernel module: readable in a container given no GPU too
SMI_QUERY = ["nvidia-smi", "--query-gpu=driver_version,name,compute_cap,mig.mode.current", "--format=csv,noheader"]
SMI_QUERY_OLD = ["nvidia-smi", "--query-gpu=driver_version,name", "--format=csv,noheader"]  # drivers before 510
SMOKE_TIMEOUT = 300  # seconds for the one-kernel Triton test (its first compile, ptxas included)

# NVIDIA's CUDA toolkit release notes, Linux x86_64. Table 3: the driver each CUDA release ships with (what its
# toolkit is built and tested against). Table 2: the oldest driver a CUDA major version runs on at all, through
# minor version compatibility (compiled kernels load; PTX compiled at run time does not).
CUDA_TOOLKIT_DRIVER = {"13.2": "595.45.04", "13.1": "590.44.01", "13.0": "580.65.06", "12.9": "575.51.03",
                       "12.8": "570.26", "12.6": "560.28.03", "12.5": "555.42.02", "12.4": "550.54.14",
                       "12.3": "545.23.06", "12.2": "535.54.03", "12.1": "530.30.02", "12.0": "525.60.13",
                       "11.8": "520.61.05"}
CUDA_MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}
# Where a directory the checks name is mounted from on the host, in the fix they give inside a container
HOST_MOUNT = {"--output_dir": "$PWD/artifacts", "HF_HOME": "$HOME/.cache/huggingface",
              "DPO_KIT_CACHE": "$HOME/.cache/huggingface/dpo-kit"}


@dataclasses.dataclass
class PreflightConfig:
    require_gpu: bool = field(False, "no usable NVIDIA GPU is a failure (the launcher's --gpus asks for this)")
    allow_cpu: bool = field(False, "train on the CPU although an NVIDIA GPU is here that PyTorch cannot use "
                            "(a warning instead of a failure)")
    nproc: int = field(1, "processes on this machine: several need /dev/shm (NCCL) and whole GPUs (not MIG slices)")
    output_dir: str = field("", "a directory the run writes, which must be writable ('' = none checked)")
    model: str = field("", "the model to load: a hub id is downloaded into HF_HOME, which must then be writable")
    triton: bool = field(True, "Triton's kernels will run (the kit's fused ops, Liger): test its toolchain")
    bitsandbytes: bool = field(True, "import bitsandbytes (4-bit loading) and report its version")

    def problems(self) -> list[str]:
        return [f"--nproc {self.nproc}: expected at least 1"] if self.nproc < 1 else []


@dataclasses.dataclass(frozen=True)
class Gpu:
    """One line of nvidia-smi's --query-gpu CSV."""
    driver: str
    name: str
    capability: str = ""  # "9.0"; "" where nvidia-smi does not say (drivers before 510)
    mig: str = ""  # "Enabled" / "Disabled"; "" on GPUs without MIG


@dataclasses.dataclass(frozen=True)
class Dir:
    label: str  # "--output_dir", "HF_HOME", "DPO_KIT_CACHE"
    path: str
    must: bool  # the run fails without it (a failure), or only caches there (a warning)
    writable: bool


@dataclasses.dataclass
class Facts:
    """What `gather` found; every check reads these fields and nothing else."""
    smi: str | None = None  # nvidia-smi's --query-gpu CSV; None: no nvidia-smi on PATH
    smi_failed: str = ""  # what nvidia-smi said when it exited non-zero (no driver, no devices)
    smi_list: str = ""  # nvidia-smi -L: the GPUs, with their MIG devices under them
    proc_driver: str | None = None  # the kernel module's version (PROC_DRIVER), where one is loaded
    torch: str | None = None  # torch.__version__; None: torch does not import (torch_error says why)
    torch_error: str = ""
    torch_cuda: str | None = None  # torch.version.cuda; None: the CPU build
    cuda_available: bool = False
    cuda_error: str = ""  # what torch warned when CUDA did not initialise
    arch_list: tuple[str, ...] = ()  # torch.cuda.get_arch_list(): sm_80, sm_90, ..., compute_120 (PTX)
    devices: tuple[tuple[str, str], ...] = ()  # torch's view, where CUDA works: (name, "9.0") per device
    bnb: str | None = None  # bitsandbytes.__version__ when imported
    bnb_error: str = ""
    shm_bytes: int | None = None  # /dev/shm's size; None: no /dev/shm (macOS)
    user: str = ""  # "uid 1000 (gid 1000)"
    in_container: bool = False
    dirs: tuple[Dir, ...] = ()
    triton: str | None = None  # its version; None: not installed
    cc: str | None = None  # the C compiler Triton takes: $CC, else gcc, else clang (runtime/build.py)
    cc_env: str = ""  # $CC as set
    python_h: bool = True  # Python.h where Triton looks for it (the launcher it builds includes it)
    python_dev: str = "python3-dev"  # the Debian/Ubuntu package that holds it
    smoke: str | None = None  # the Triton test: "" passed, else its error; None: not run
    sandbox: str = ""  # the mode model-written code runs in here (sandbox.py): bwrap, unshare or limits; "": not probed
    sandbox_why: str = ""  # why not bwrap, where it is not
    landlock: int = 0  # the kernel's Landlock ABI level


@dataclasses.dataclass(frozen=True)
class Finding:
    level: str  # ok | note | warn | fail
    text: str  # one sentence, no final period; a failure's says what to do


# ---------------------------------------------------------------------------------------------
# Pure: parsing what the tools print, and the decisions.
# ---------------------------------------------------------------------------------------------

def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version))


def first_clause(text: str, limit: int = 160) -> str:
    """The first line and sentence of a tool's message, to quote inside one of ours."""
    line = next((x.strip() for x in text.splitlines() if x.strip()), "")
    line = re.split(r"(?<=[a-z0-9)])\.\s", line)[0].rstrip(".")
    return line if len(line) <= limit else line[:limit - 3] + "..."


def parse_gpus(csv_text: str) -> list[Gpu]:
    """nvidia-smi --query-gpu=driver_version,name[,compute_cap,mig.mode.current] --format=csv,noheader."""
    out = []
    for line in csv_text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 2 or not re.fullmatch(r"\d+(\.\d+)+", cells[0]):
            continue
        known = ["" if c.startswith("[") or c == "N/A" else c for c in cells[2:4]]  # [N/A], [Not Supported]
        out.append(Gpu(cells[0], cells[1], *known))
    return out


def mig_devices(listing: str) -> list[str]:
    """The MIG profiles nvidia-smi -L lists ("  MIG 3g.20gb     Device  0: (UUID: MIG-...)")."""
    return re.findall(r"^\s*MIG\s+(\S+)\s+Device\s+\d+", listing, re.MULTILINE)


def lock_cuda(requirements: str) -> str | None:
    """The CUDA the lock's torch is built for, from its runtime wheel: nvidia-cuda-runtime==13.0.96 -> 13.0
    (nvidia-cuda-runtime-cu12==12.8.90 -> 12.8); None for a lock without one."""
    m = re.search(r"^nvidia-cuda-runtime(?:-cu\d+)?==(\d+)\.(\d+)", requirements, re.MULTILINE)
    return f"{m[1]}.{m[2]}" if m else None


def driver_floor(cuda: str) -> tuple[str | None, str | None]:
    """(the oldest driver CUDA `cuda` runs on at all, the driver that CUDA release ships with)."""
    return CUDA_MIN_DRIVER.get(version_tuple(cuda)[0]), CUDA_TOOLKIT_DRIVER.get(".".join(cuda.split(".")[:2]))


def driver_problem(driver: str, cuda: str, built: str) -> tuple[str, str, str] | None:
    """(level, what, fix) when `driver` is older than CUDA `cuda` wants; built names what was built for it
    ("PyTorch 2.13.0"). Below the major version's floor nothing runs (fail); below the release's own driver,
    minor version compatibility runs compiled kernels but not PTX compiled at run time (warn)."""
    floor, shipped = driver_floor(cuda)
    have = version_tuple(driver)
    if floor and have < version_tuple(floor):
        branch = (shipped or floor).split(".")[0]
        return ("fail", f"the NVIDIA driver {driver} is too old for {built}, a CUDA {cuda} build that needs driver "
                        f"{floor} or newer", f"upgrade the driver to the {branch} branch or newer (the GPU VM's "
                        f"driver image, or sudo apt-get install nvidia-driver-{branch}-server, then reboot)")
    if shipped and have < version_tuple(shipped):
        return ("warn", f"the NVIDIA driver {driver} runs {built} (CUDA {cuda}, which ships with driver {shipped}) "
                        "through CUDA minor version compatibility only, where compiled kernels load and PTX compiled "
                        f"at run time does not", f"upgrade the driver to {shipped} or newer if a kernel fails to load")
    return None


def arch_runs(capability: str, arch: str) -> bool:
    """Does a wheel's arch (sm_80, sm_90a, compute_120) run on a GPU of this compute capability? A cubin runs on
    its major version at its minor or above; an arch-specific one (sm_90a) on its own only; PTX on it and later."""
    m = re.fullmatch(r"(sm|compute)_(\d+)(\d)([af]?)", arch)
    if not m or not re.fullmatch(r"\d+\.\d+", capability):
        return False
    gpu, built = version_tuple(capability), (int(m[2]), int(m[3]))
    if m[4]:
        return gpu == built
    return gpu[0] == built[0] and gpu[1] >= built[1] if m[1] == "sm" else gpu >= built


def capability_problem(gpu: Gpu, arch_list: tuple[str, ...], built: str) -> tuple[str, str] | None:
    """(what, fix) when the wheels have no kernel that runs on this GPU (torch.cuda.get_arch_list())."""
    if not gpu.capability or not arch_list or any(arch_runs(gpu.capability, a) for a in arch_list):
        return None
    cubins = sorted(divmod(version_tuple(a)[0], 10) for a in arch_list if a.startswith("sm_"))
    if cubins and version_tuple(gpu.capability) < cubins[0]:
        fix = (f"use a GPU of compute capability {cubins[0][0]}.{cubins[0][1]} or newer (CUDA 13 builds dropped "
               "Maxwell, Pascal and Volta)")
    else:
        fix = "use a newer PyTorch release, which has kernels for it"
    return (f"the {gpu.name} has compute capability {gpu.capability}, which {built} has no kernels for (it has "
            f"{', '.join(arch_list)})", fix)


def smi_failed_problem(message: str) -> tuple[str, str]:
    """(what, fix) for an nvidia-smi that exited non-zero."""
    said = first_clause(message)
    if "couldn't communicate with the NVIDIA driver" in message or "driver/library version mismatch" in message.lower():
        return (f"nvidia-smi is here but the NVIDIA driver does not answer ({said})",
                "load the driver (reboot after installing or upgrading it)")
    if "No devices were found" in message:
        return "nvidia-smi finds no GPU", "start the container with --gpus all, and on a VM check that it has a GPU"
    return f"nvidia-smi failed ({said})", "fix the NVIDIA driver until nvidia-smi lists the GPU"


def gpu_blocked(cfg: PreflightConfig, what: str, fix: str) -> Finding:
    """A GPU this run cannot use: a failure naming the fix (and --allow_cpu, unless a GPU was required), or under
    --allow_cpu a warning, the run taking the CPU."""
    if cfg.allow_cpu and not cfg.require_gpu:
        return Finding("warn", f"{what}; training runs on the CPU (--allow_cpu)")
    return Finding("fail", f"{what}: {fix}" + ("" if cfg.require_gpu else ", or pass --allow_cpu to train on the CPU"))


def gpu_findings(cfg: PreflightConfig, f: Facts) -> list[Finding]:
    """Is there a GPU, and can this PyTorch use it? What a CPU run would sidestep is a warning under --allow_cpu
    (and the run takes the CPU), else a failure."""
    if f.smi_failed and not f.cuda_available:
        return [gpu_blocked(cfg, *smi_failed_problem(f.smi_failed))]
    gpus = parse_gpus(f.smi or "") or [Gpu(f.proc_driver or "", name, cap) for name, cap in f.devices]
    if not gpus:
        if f.proc_driver:
            return [gpu_blocked(cfg, f"this machine has an NVIDIA driver ({f.proc_driver}) but no GPU is visible here",
                            "start the container with --gpus all (the host needs the NVIDIA Container Toolkit)")]
        if cfg.require_gpu:
            return [Finding("fail", "no NVIDIA GPU is visible (no nvidia-smi, no NVIDIA driver): run on a GPU machine "
                                    "and start the container with --gpus all (the host needs the NVIDIA Container "
                                    "Toolkit), or leave out --gpus to train on the CPU")]
        return [Finding("note", "no NVIDIA GPU here: training runs on the CPU")]
    if f.torch is None:
        return [Finding("fail", f"PyTorch does not import ({first_clause(f.torch_error)}): reinstall it from the lock "
                                "(make venv), or rebuild the image")]
    name, driver = gpus[0].name, gpus[0].driver
    if f.torch_cuda is None:
        what = f"an NVIDIA GPU is here ({name}, driver {driver}) but PyTorch {f.torch} is its CPU build"
        return [gpu_blocked(cfg, what, "install the CUDA build (make distclean venv on this machine, or train in the "
                                       "image: RUNNER=docker)")]
    built = f"PyTorch {f.torch}"
    out = []
    old = driver_problem(driver, f.torch_cuda, built) if driver else None
    if old and old[0] == "fail" and not f.cuda_available:
        return [gpu_blocked(cfg, *old[1:])]
    if old and old[0] == "fail":  # and yet CUDA works: a datacenter GPU with CUDA's forward-compatibility package
        out.append(Finding("warn", f"{old[1]}, yet CUDA initialises (the forward-compatibility package?): if a kernel "
                                   f"fails to load, {old[2]}"))
    elif old:
        out.append(Finding("warn", f"{old[1]}: {old[2]}"))
    if not f.cuda_available:
        mig = mig_findings(cfg, gpus, f.smi_list)
        if mig and not mig_devices(f.smi_list):  # MIG on without instances: CUDA sees no device, and that is why
            return out + mig
        why = f" ({first_clause(f.cuda_error)})" if f.cuda_error else ""
        what = f"{built} (CUDA {f.torch_cuda}) cannot use the {name} that nvidia-smi lists{why}"
        return out + [gpu_blocked(cfg, what, "check CUDA_VISIBLE_DEVICES, and that the container was started with "
                                             "--gpus all")]
    for gpu in gpus:  # CUDA initialises, so the run would take this GPU (and fail at its first kernel): no --allow_cpu
        unsupported = capability_problem(gpu, f.arch_list, f"{built} (CUDA {f.torch_cuda})")
        if unsupported:
            out.append(Finding("fail", f"{unsupported[0]}: {unsupported[1]}, or hide it (CUDA_VISIBLE_DEVICES=) and "
                                       "pass --allow_cpu to train on the CPU"))
    out += mig_findings(cfg, gpus, f.smi_list)
    if not any(x.level == "fail" for x in out):
        out.append(Finding("ok", f"{len(gpus)} GPU(s) usable by {built} (CUDA {f.torch_cuda})"
                                 + (f" on driver {driver}" if driver else "")))
    return out


def mig_findings(cfg: PreflightConfig, gpus: list[Gpu], listing: str) -> list[Finding]:
    """MIG splits a GPU into instances, and a CUDA process sees one MIG device: a slice of its memory and SMs."""
    enabled = [g for g in gpus if g.mig.lower() == "enabled"]
    devices = mig_devices(listing)
    if not enabled and not devices:
        return []
    name = (enabled or gpus or [Gpu("", "GPU")])[0].name
    if not devices:
        return [gpu_blocked(cfg, f"MIG mode is on for the {name} but it has no MIG instances, so CUDA sees no device",
                            "create one (sudo nvidia-smi mig -lgip lists the profiles, sudo nvidia-smi mig -cgi "
                            "PROFILE -C creates it), or turn MIG off (sudo nvidia-smi -i 0 -mig 0, then reset the "
                            "GPU)")]
    if cfg.nproc > 1:
        return [Finding("fail", f"MIG is on ({len(devices)} MIG device(s): {', '.join(devices)}), and each process "
                                "can use one MIG device with no NCCL between them, so --nproc "
                                f"{cfg.nproc} cannot train together: train with one process on one MIG device, or "
                                "turn MIG off for whole GPUs (sudo nvidia-smi -i 0 -mig 0)")]
    return [Finding("warn", f"MIG is on: this run gets one MIG device ({devices[0]}), a slice of the {name}'s memory "
                            "and SMs, so size --per_device_train_batch_size and --max_length to it, or ask for whole "
                            "GPUs (MIG off) for the full speed")]


def shm_findings(cfg: PreflightConfig, shm_bytes: int | None, on_gpu: bool) -> list[Finding]:
    """Docker's 64 MB /dev/shm: NCCL between processes on GPUs fails in it (gloo on CPUs does not use it)."""
    if shm_bytes is None or shm_bytes >= SHM_MIN:
        return []
    size = f"{shm_bytes / (1 << 20):,.0f} MB"
    if cfg.nproc > 1 and on_gpu:
        return [Finding("fail", f"/dev/shm is {size}, too small for NCCL between {cfg.nproc} processes: start the "
                                "container with --shm-size 8g (the launcher's default), or remount /dev/shm larger")]
    return [Finding("warn", f"/dev/shm is {size}, enough for one process but not for several (NCCL) or for "
                            "DataLoader workers: start the container with --shm-size 8g (the launcher's default)")]


def dir_findings(f: Facts) -> list[Finding]:
    """A directory the run must write is a failure; a cache it cannot write is a warning (nothing is kept)."""
    out = []
    for d in f.dirs:
        if d.writable:
            continue
        where = f"{d.label} {d.path}" if d.label.startswith("-") else f"{d.label}={d.path}"
        if f.in_container:
            fix = (f'mount a host directory you own there (-v "{HOST_MOUNT.get(d.label, "$PWD/dir")}:{d.path}") '
                   'and run as yourself (--user "$(id -u):$(id -g)")')
        else:
            fix = f"make it writable (chown or chmod it) or point {d.label} at a directory you own"
        what = f"{where} is not writable by {f.user}" + ("" if d.must else ", so nothing is cached there")
        out.append(Finding("fail" if d.must else "warn", f"{what}: {fix}"))
    return out


def triton_findings(cfg: PreflightConfig, f: Facts, on_gpu: bool) -> list[Finding]:
    """Triton compiles a small C launcher at its first kernel, with the system's C compiler and Python.h. On a
    GPU that is a failure when missing (the fused kernels need it); on the CPU, where its kernels do not run, a
    warning."""
    if f.triton is None:
        return [Finding("note", "Triton is not installed, so its kernels do not run here and its test is skipped")]
    if not cfg.triton:
        return []
    level = "fail" if on_gpu else "warn"
    off = ", or train with --no_fused_ops (no Triton kernels)" if on_gpu else " (its kernels run only on a GPU)"
    if f.cc is None:
        if f.cc_env:
            return [Finding(level, f"Triton needs a C compiler: CC={f.cc_env} is not one it can run, so set CC to a "
                                   f"compiler or unset it (gcc is then used){off}")]
        return [Finding(level, "Triton needs a C compiler: install gcc (apt-get install gcc in the image) or set CC to "
                               f"one{off}")]
    if not f.python_h and on_gpu:
        return [Finding(level, f"Triton needs Python's C headers (Python.h) to build its launcher: install "
                               f"{f.python_dev} (apt-get install {f.python_dev} in the image){off}")]
    if f.smoke is None:
        return []
    if f.smoke == "":
        how = "compiled and ran on the GPU" if on_gpu else "ran under Triton's interpreter (no GPU here)"
        return [Finding("ok", f"Triton {f.triton}: a one-kernel test {how}")]
    return [Finding(level, smoke_problem(f.smoke, f.python_dev) + off)]


def smoke_problem(error: str, python_dev: str = "python3-dev") -> str:
    """One sentence (no fix for turning Triton off: the caller adds it) for what the Triton test printed."""
    if "Failed to find C compiler" in error:
        return "Triton needs a C compiler: install gcc (apt-get install gcc in the image) or set CC to one"
    if "Python.h" in error:
        return f"Triton needs Python's C headers (Python.h) to build its launcher: install {python_dev}"
    if "Permission denied" in error and ".triton" in error:
        return ("Triton cannot write its kernel cache (~/.triton): set TRITON_CACHE_DIR to a writable directory, "
                "or HOME to one")
    if error.startswith("timeout"):
        return f"the one-kernel Triton test did not finish in {SMOKE_TIMEOUT} s: check the GPU with nvidia-smi"
    return f"a one-kernel Triton test failed ({first_clause(error.splitlines()[-1] if error.strip() else error)})"


def smoke_mode(cfg: PreflightConfig, f: Facts, on_gpu: bool) -> str | None:
    """How to run the Triton test: "cuda" on a usable GPU, "interpret" (TRITON_INTERPRET=1) without one; None
    when it is not installed, not wanted, or its toolchain is already known to be missing (reported instead)."""
    if f.triton is None or not cfg.triton or f.torch is None or f.cc is None:
        return None
    if not on_gpu:
        return "interpret"
    return "cuda" if f.python_h else None


def bnb_findings(cfg: PreflightConfig, f: Facts) -> list[Finding]:
    if not cfg.bitsandbytes or f.bnb is not None:
        return []
    return [Finding("fail", f"bitsandbytes does not import ({first_clause(f.bnb_error)}): reinstall it from the lock "
                            "(make venv, or rebuild the image), or train with --no_load_in_4bit")]


def gpu_usable(cfg: PreflightConfig, f: Facts) -> bool:
    return f.cuda_available and not any(x.level == "fail" for x in gpu_findings(cfg, f))


def findings(cfg: PreflightConfig, f: Facts) -> list[Finding]:
    """Every check, in the order a user would fix them."""
    on_gpu = gpu_usable(cfg, f)
    return (gpu_findings(cfg, f) + shm_findings(cfg, f.shm_bytes, on_gpu) + dir_findings(f) + bnb_findings(cfg, f)
            + triton_findings(cfg, f, on_gpu) + sandbox_findings(f))


def sandbox_findings(f: Facts) -> list[Finding]:
    """The mode model-written code (the checker's answers, GRPO's rewards, users' graders) runs in here: a note for
    bwrap or unshare, a loud warning for limits, where an answer that names a host path cannot be scored."""
    if not f.sandbox:
        return []
    landlock = f"Landlock ABI {f.landlock}" if f.landlock else "no Landlock"
    if f.sandbox != "limits":
        return [Finding("ok", f"sandbox: model-written code runs in {f.sandbox} mode ({landlock})")]
    where = ("run the image with the kit's seccomp profile (make train RUNNER=docker passes it; docs/container.md)"
             if f.in_container else "install bubblewrap (apt-get install bubblewrap), or run as root for unshare")
    return [Finding("warn", f"SANDBOX IN LIMITS MODE: bubblewrap cannot run here ({first_clause(f.sandbox_why)}), so "
                            f"model-written code runs without namespaces ({landlock}), and every answer that names a "
                            "host path (/home/<user>, /var/log, /srv) is left unscored in rewards and reports; to "
                            f"score them, {where}")]


def host_findings(want_gpu: bool, cpu_ok: bool, smi: str | None, smi_failed: str,
                  image_cuda: str | None) -> list[Finding]:
    """The launcher's host, before `docker run`: the image's CUDA (image_cuda, from the lock) against the host's
    driver, whose refusal ("unsatisfied condition: cuda>=13.0") would otherwise come from the engine; and a GPU
    host about to train on the CPU without --allow_cpu (cpu_ok: it was passed, or nothing trains)."""
    gpus = parse_gpus(smi or "")
    if want_gpu and smi is None:
        return [Finding("fail", "--gpus was given but this host has no nvidia-smi: install the NVIDIA driver and the "
                                "NVIDIA Container Toolkit, or leave out --gpus to train on the CPU")]
    if want_gpu and smi_failed:
        what, fix = smi_failed_problem(smi_failed)
        return [Finding("fail", f"{what} on this host: {fix}")]
    if not want_gpu and gpus and not cpu_ok:
        return [Finding("fail", f"this host has {len(gpus)} NVIDIA GPU(s) ({gpus[0].name}) but --gpus was not given, "
                                "so the container would train on the CPU: add --gpus all (make: GPUS=all), or pass "
                                "-- --allow_cpu to train on the CPU anyway")]
    if want_gpu and gpus and image_cuda:
        old = driver_problem(gpus[0].driver, image_cuda, "the image's PyTorch")
        if old:
            what = old[1].replace("the NVIDIA driver", "the host's NVIDIA driver", 1)
            return [Finding(old[0], f"{what}: {old[2]}")]
    return []


# ---------------------------------------------------------------------------------------------
# Edges: what the machine says.
# ---------------------------------------------------------------------------------------------

def read_nvidia_smi(timeout: int = 30) -> tuple[str | None, str, str]:
    """(the --query-gpu CSV or None without nvidia-smi, what it said when it failed, nvidia-smi -L)."""
    if shutil.which("nvidia-smi") is None:
        return None, "", ""

    def run(cmd):
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            return done.returncode, (done.stdout + done.stderr).strip()
        except subprocess.TimeoutExpired:
            return 1, f"{cmd[0]} did not answer in {timeout} s"
        except OSError as e:
            return 1, str(e)

    code, out = run(SMI_QUERY)
    if code != 0 and "not a valid field" in out:
        code, out = run(SMI_QUERY_OLD)
    if code != 0:
        return "", out or f"exit status {code}", ""
    code, listing = run(["nvidia-smi", "-L"])
    return out, "", listing if code == 0 else ""


def writable(path: str) -> bool:
    """Can this uid create files in path (or create path: its nearest existing parent)?"""
    import tempfile

    p = Path(path).absolute()
    if p.is_dir():
        try:
            with tempfile.TemporaryFile(dir=p):
                return True
        except OSError:
            return False
    while not p.exists() and p != p.parent:
        p = p.parent
    return p.is_dir() and os.access(p, os.W_OK | os.X_OK)


def is_hub_id(model: str) -> bool:
    return bool(model) and not model.startswith(("random:", ".", "/")) and not Path(model).exists() \
        and model.count("/") == 1


def torch_facts(want_bnb: bool, want_devices: bool) -> dict:
    """torch's version, CUDA build, whether CUDA initialises (and its warning when not), the arch list; the
    devices only when asked (nvidia-smi did not list them): that initialises CUDA in this process."""
    import warnings

    try:
        import torch
    except Exception as e:  # noqa: BLE001 - whatever stops it importing is the report
        return {"torch": None, "torch_error": f"{type(e).__name__}: {e}"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    out = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda_available": available,
           "cuda_error": "" if available else next((str(w.message) for w in caught), ""),
           "arch_list": tuple(torch.cuda.get_arch_list()) if available else ()}
    if available and want_devices:
        out["devices"] = tuple((torch.cuda.get_device_name(i), "%d.%d" % torch.cuda.get_device_capability(i))
                               for i in range(torch.cuda.device_count()))
    if want_bnb:
        try:
            import bitsandbytes

            out["bnb"] = bitsandbytes.__version__
        except Exception as e:  # noqa: BLE001
            out["bnb_error"] = f"{type(e).__name__}: {e}"
    return out


def triton_toolchain(env) -> dict:
    """Triton's version (found, not imported), and the C compiler and Python.h it would use (runtime/build.py)."""
    import importlib.metadata
    import importlib.util
    import sysconfig

    if importlib.util.find_spec("triton") is None:
        return {}
    try:
        version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        version = "(version unknown)"
    cc_env = env.get("CC", "")
    cc = shutil.which(cc_env) if cc_env else shutil.which("gcc") or shutil.which("clang")
    scheme = sysconfig.get_default_scheme()
    include = sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"]
    return {"triton": version, "cc": cc, "cc_env": cc_env, "python_h": (Path(include) / "Python.h").exists(),
            "python_dev": f"python{sys.version_info.major}.{sys.version_info.minor}-dev"}


SMOKE = '''
import torch, triton, triton.language as tl

@triton.jit
def add_one(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)

x = torch.zeros(16, device="{device}")
add_one[(1,)](x, 16, BLOCK=16)
assert x.sum().item() == 16, x
'''


def triton_smoke(mode: str, env) -> str:
    """One kernel, in a child process (a crash or a hang stays there): "" when it ran, else the end of its error."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="dpo-kit-triton-") as tmp:
        script = Path(tmp) / "triton_smoke.py"  # @triton.jit reads the function's source from a file
        script.write_text(SMOKE.format(device="cuda" if mode == "cuda" else "cpu"))
        child_env = {**env, **({"TRITON_INTERPRET": "1"} if mode == "interpret" else {})}
        try:
            done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=child_env,
                                  timeout=SMOKE_TIMEOUT)
        except subprocess.TimeoutExpired:
            return "timeout"
    if done.returncode == 0:
        return ""
    lines = [x for x in (done.stderr or done.stdout).strip().splitlines() if x.strip()]
    said = next((x for x in lines if "Failed to find C compiler" in x or "Python.h" in x), lines[-1] if lines else "")
    return said or f"exit status {done.returncode}"


def gather(cfg: PreflightConfig, env) -> Facts:
    smi, smi_failed, listing = read_nvidia_smi()
    try:
        driver = Path(PROC_DRIVER).read_text()
        m = re.search(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+(?:\.\d+)+)", driver)
        proc_driver = m[1] if m else "unknown"
    except OSError:
        proc_driver = None
    try:
        stat = os.statvfs("/dev/shm")
        shm = stat.f_blocks * stat.f_frsize
    except OSError:
        shm = None
    dirs = [Dir("--output_dir", cfg.output_dir, True, writable(cfg.output_dir))] if cfg.output_dir else []
    for name, must in (("HF_HOME", is_hub_id(cfg.model)), ("DPO_KIT_CACHE", False)):
        if env.get(name):
            dirs.append(Dir(name, env[name], must, writable(env[name])))
    f = Facts(smi=smi, smi_failed=smi_failed, smi_list=listing, proc_driver=proc_driver, shm_bytes=shm,
              user=f"uid {os.getuid()} (gid {os.getgid()})", dirs=tuple(dirs),
              in_container=Path("/.dockerenv").exists() or Path("/run/.containerenv").exists(),
              **torch_facts(cfg.bitsandbytes, want_devices=not parse_gpus(smi or "")),
              **triton_toolchain(env))
    mode = smoke_mode(cfg, f, gpu_usable(cfg, f))
    if mode:
        f.smoke = triton_smoke(mode, env)
    f.sandbox, f.sandbox_why, f.landlock = sandbox_facts()
    return f


def sandbox_facts() -> tuple[str, str, int]:
    """(the sandbox's mode here, why not bwrap, the Landlock ABI level): sandbox.py's own probe, which runs code."""
    try:
        mode = sandbox.isolation()
        forced = os.environ.get(sandbox.ENV, "").strip()
        return mode, sandbox.why_not("bwrap") or (f"{sandbox.ENV}={forced}" if forced else ""), sandbox.landlock_abi()
    except kit.UserError as e:  # DPO_KIT_SANDBOX names a mode this machine cannot run
        return "limits", str(e), sandbox.landlock_abi()


def describe(f: Facts) -> list[str]:
    """What was found, before the verdicts: torch, the GPUs, bitsandbytes."""
    torch = (f"torch {f.torch} ({'CUDA ' + f.torch_cuda if f.torch_cuda else 'CPU build'}), "
             f"CUDA available: {f.cuda_available}" if f.torch else "torch: does not import")
    lines = [torch]
    for i, g in enumerate(parse_gpus(f.smi or "")):
        lines.append(f"  GPU {i}: {g.name}, driver {g.driver}" + (f", compute capability {g.capability}" if g.capability
                     else "") + (f", MIG {g.mig}" if g.mig else ""))
    lines += [f"  cuda:{i} {name}, compute capability {cap}" for i, (name, cap) in enumerate(f.devices)]
    if f.bnb:
        lines.append(f"bitsandbytes {f.bnb}")
    return lines


def report(f: Facts, found: list[Finding]) -> bool:
    """Print what was found and each verdict (failures on stderr, one sentence each); True when none failed."""
    for line in describe(f):
        print(f"[preflight] {line}")
    for x in found:
        if x.level == "fail":
            print(f"error: {x.text}.", file=sys.stderr)
        else:
            print(f"[preflight] {'warning: ' if x.level == 'warn' else ''}{x.text}")
    sys.stdout.flush()
    return not any(x.level == "fail" for x in found)


def for_training(cfg) -> PreflightConfig:
    """What a train_dpo.py run (its TrainConfig) needs from the machine: its output directory, its model's
    downloads, Triton where the fused kernels run, /dev/shm and whole GPUs for several processes on this machine."""
    local = ranks.world()
    return PreflightConfig(allow_cpu=cfg.allow_cpu, nproc=max(local["world_size"] // local["nodes"], 1),
                           output_dir=cfg.output_dir, model=cfg.model_name_or_path,
                           triton=cfg.fused_ops or cfg.use_liger_kernel, bitsandbytes=False)


def passes(cfg: PreflightConfig, env=None) -> bool:
    """Gather, decide, report: True when this machine can run what cfg describes."""
    env = dict(os.environ) if env is None else env
    facts = gather(cfg, env)
    return report(facts, findings(cfg, facts))


def main(argv=None) -> int:
    cfg = kit.parse_config(PreflightConfig, argv, __doc__)
    return 0 if passes(cfg) else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(kit.run_cli(main))
