"""preflight.py: each check on worked examples of the facts, then `entrypoint.py check` and `launcher.py check`
end to end with fake nvidia-smi executables (old driver, no driver, MIG, a good one) first on PATH, and with no C
compiler on PATH: every failure is one sentence saying what to do, and none ends in a traceback.

    .venv/bin/python -m pytest -q tests/test_preflight.py
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from dpokit.model import preflight
from dpokit.model.preflight import Dir, Facts, Finding, Gpu, PreflightConfig

ROOT = Path(__file__).resolve().parent.parent
H100 = "580.95.05, NVIDIA H100 80GB HBM3, 9.0, Disabled"
H100_LIST = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-5a1e8d4e-0000-0000-0000-000000000000)"
CUDA13_ARCHS = ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120")  # a CUDA 13.0 torch's list
# What the fake nvidia-smi prints for --query-gpu, -L, and its exit status: canned from real drivers' output.
SMI = {
    "good": (H100, H100_LIST, 0),
    "old_driver": ("535.183.01, NVIDIA A100-SXM4-80GB, 8.0, Disabled",
                   "GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-1)", 0),
    "no_driver": ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the "
                  "latest NVIDIA driver is installed and running.", "", 9),
    "no_devices": ("No devices were found", "", 6),
    "mig": ("580.95.05, NVIDIA A100-SXM4-40GB, 8.0, Enabled",
            "GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-2)\n"
            "  MIG 3g.20gb     Device  0: (UUID: MIG-3)\n"
            "  MIG 3g.20gb     Device  1: (UUID: MIG-4)", 0),
    "mig_no_instances": ("580.95.05, NVIDIA A100-SXM4-40GB, 8.0, Enabled", "GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-2)", 0),
}


def one_sentence(text: str) -> bool:
    """No line break, no traceback, and no full stop followed by a new sentence (version numbers are fine)."""
    return "\n" not in text.strip() and "Traceback" not in text and not re.search(r"[a-z)]\. +[A-Z]", text)


def good_facts(**over) -> Facts:
    """An H100 that a CUDA 13.0 torch can use, on a machine where everything else is fine."""
    base = dict(smi=H100, smi_list=H100_LIST, torch="2.13.0", torch_cuda="13.0", cuda_available=True,
                arch_list=CUDA13_ARCHS, shm_bytes=8 << 30, user="uid 1000 (gid 1000)", cc="/usr/bin/gcc",
                triton="3.7.1", smoke="", bnb="0.50.2")
    return Facts(**{**base, **over})


def levels(found: list[Finding]) -> list[str]:
    return [x.level for x in found]


def texts(found: list[Finding], level: str = "fail") -> list[str]:
    return [x.text for x in found if x.level == level]


# ---------------------------------------------------------------------------------------------
# Pure: parsing and the decisions.
# ---------------------------------------------------------------------------------------------

def test_parse_gpus_reads_the_query_and_what_old_drivers_leave_out():
    assert preflight.parse_gpus(H100 + "\n" + H100) == [Gpu("580.95.05", "NVIDIA H100 80GB HBM3", "9.0", "Disabled")] * 2
    assert preflight.parse_gpus("470.256.02, Tesla T4") == [Gpu("470.256.02", "Tesla T4")]  # before compute_cap
    assert preflight.parse_gpus("550.54.14, NVIDIA L4, 8.9, [N/A]") == [Gpu("550.54.14", "NVIDIA L4", "8.9", "")]
    assert preflight.parse_gpus(SMI["no_driver"][0]) == [] and preflight.parse_gpus("") == []
    assert preflight.mig_devices(SMI["mig"][1]) == ["3g.20gb", "3g.20gb"] and preflight.mig_devices(H100_LIST) == []


def test_the_lock_names_its_cuda():
    assert preflight.lock_cuda((ROOT / "requirements.txt").read_text()) == "13.0"  # torch 2.13 from PyPI
    assert preflight.lock_cuda("torch==2.7.1\nnvidia-cuda-runtime-cu12==12.8.90\n") == "12.8"
    assert preflight.lock_cuda("torch==2.13.0\n") is None


def test_driver_floors_follow_nvidias_release_notes():
    """Table 3 (the driver each release ships with) and Table 2 (minor version compatibility's floor)."""
    assert preflight.driver_floor("13.0") == ("580.65.06", "580.65.06")
    assert preflight.driver_floor("12.8") == ("525.60.13", "570.26")
    assert [preflight.driver_floor(c)[1] for c in ("12.6", "12.4", "12.1", "11.8")] == [
        "560.28.03", "550.54.14", "530.30.02", "520.61.05"]
    assert preflight.driver_floor("14.0") == (None, None)  # unknown: nothing claimed


def test_driver_problem_fails_below_the_floor_and_warns_in_minor_version_compatibility():
    level, what, fix = preflight.driver_problem("535.183.01", "13.0", "PyTorch 2.13.0")
    assert level == "fail" and "535.183.01" in what and "CUDA 13.0" in what and "580.65.06" in what
    assert fix.startswith("upgrade the driver to the 580 branch or newer")
    level, what, fix = preflight.driver_problem("550.54.14", "12.8", "PyTorch 2.7.1")
    assert level == "warn" and "minor version compatibility" in what and "570.26" in fix
    assert preflight.driver_problem("580.95.05", "13.0", "PyTorch 2.13.0") is None
    assert preflight.driver_problem("580.65.06", "13.0", "PyTorch 2.13.0") is None  # the floor itself is enough


def test_compute_capability_against_the_wheels_arch_list():
    runs = preflight.arch_runs
    assert runs("8.6", "sm_80") and not runs("8.0", "sm_86") and not runs("9.0", "sm_80")  # cubins: same major
    assert runs("9.0", "sm_90a") and not runs("10.0", "sm_90a")  # arch-specific: that GPU only
    assert runs("12.1", "compute_120") and not runs("8.0", "compute_120")  # PTX: JIT to newer GPUs
    assert preflight.capability_problem(Gpu("580.95.05", "NVIDIA H100", "9.0"), CUDA13_ARCHS, "PyTorch 2.13.0") is None
    what, fix = preflight.capability_problem(Gpu("580.95.05", "Tesla V100-SXM2-16GB", "7.0"), CUDA13_ARCHS, "PyTorch 2.13.0")
    assert "compute capability 7.0" in what and "sm_75" in what and "7.5 or newer" in fix
    what, fix = preflight.capability_problem(Gpu("580.95.05", "Future GPU", "13.0"), ("sm_80", "sm_90"), "PyTorch 2.13.0")
    assert "newer PyTorch" in fix
    assert preflight.capability_problem(Gpu("580.95.05", "x", ""), CUDA13_ARCHS, "t") is None  # capability unknown


def test_a_usable_gpu_passes_every_check():
    found = preflight.findings(PreflightConfig(require_gpu=True, nproc=8, output_dir="/artifacts"), good_facts())
    assert levels(found) == ["ok", "ok"]
    assert found[0].text == "1 GPU(s) usable by PyTorch 2.13.0 (CUDA 13.0) on driver 580.95.05"
    assert found[1].text == "Triton 3.7.1: a one-kernel test compiled and ran on the GPU"


def test_no_gpu_is_a_cpu_run_unless_one_was_required():
    cpu = Facts(torch="2.13.0+cpu", shm_bytes=8 << 30)
    assert texts(preflight.gpu_findings(PreflightConfig(), cpu), "note") == ["no NVIDIA GPU here: training runs on the CPU"]
    [fail] = texts(preflight.gpu_findings(PreflightConfig(require_gpu=True), cpu))
    assert fail.startswith("no NVIDIA GPU is visible") and "--gpus all" in fail


def test_on_a_gpu_machine_the_cpu_needs_allow_cpu():
    """A CPU build, a container given no GPU, a driver that does not answer: failures naming the fix, and
    --allow_cpu as the way to the CPU; with --allow_cpu, warnings and a CPU run."""
    cases = {
        "CPU build": good_facts(torch="2.13.0+cpu", torch_cuda=None, cuda_available=False, arch_list=()),
        "container without --gpus": Facts(torch="2.13.0", torch_cuda="13.0", proc_driver="580.95.05"),
        "driver not loaded": Facts(torch="2.13.0", torch_cuda="13.0", smi="", smi_failed=SMI["no_driver"][0]),
        "no devices": Facts(torch="2.13.0", torch_cuda="13.0", smi="", smi_failed=SMI["no_devices"][0]),
        "CUDA does not initialise": good_facts(cuda_available=False, arch_list=(), cuda_error=(
            "CUDA initialization: Unexpected error from cudaGetDeviceCount(). Did you run some cuda functions before "
            "calling NumCudaDevices() that might have already set an error? Error 804")),
    }
    fixes = {"CPU build": "install the CUDA build", "container without --gpus": "--gpus all",
             "driver not loaded": "load the driver", "no devices": "--gpus all",
             "CUDA does not initialise": "CUDA_VISIBLE_DEVICES"}
    for case, facts in cases.items():
        [fail] = texts(preflight.gpu_findings(PreflightConfig(), facts))
        assert fixes[case] in fail and fail.endswith(", or pass --allow_cpu to train on the CPU"), (case, fail)
        assert one_sentence(fail), (case, fail)
        found = preflight.gpu_findings(PreflightConfig(allow_cpu=True), facts)
        assert levels(found) == ["warn"] and found[0].text.endswith("; training runs on the CPU (--allow_cpu)"), case
        [required] = texts(preflight.gpu_findings(PreflightConfig(require_gpu=True, allow_cpu=True), facts))
        assert "--allow_cpu" not in required, case  # the launcher asked for a GPU: no way round it


def test_an_old_driver_names_the_upgrade():
    facts = good_facts(smi="535.183.01, NVIDIA A100-SXM4-80GB, 8.0, Disabled", cuda_available=False, arch_list=(),
                       cuda_error="CUDA initialization: The NVIDIA driver on your system is too old (found version "
                                  "12020). Please update your GPU driver by downloading and installing a new version")
    [fail] = texts(preflight.findings(PreflightConfig(), facts))
    assert fail == ("the NVIDIA driver 535.183.01 is too old for PyTorch 2.13.0, a CUDA 13.0 build that needs driver "
                    "580.65.06 or newer: upgrade the driver to the 580 branch or newer (the GPU VM's driver image, or "
                    "sudo apt-get install nvidia-driver-580-server, then reboot), or pass --allow_cpu to train on the CPU")
    assert one_sentence(fail)


def test_a_gpu_the_wheels_do_not_support():
    facts = good_facts(smi="580.95.05, Tesla V100-SXM2-16GB, 7.0, [N/A]")
    [fail] = texts(preflight.findings(PreflightConfig(), facts))
    assert "Tesla V100-SXM2-16GB has compute capability 7.0" in fail and "7.5 or newer" in fail and one_sentence(fail)
    # CUDA initialises, so the run would take the GPU: --allow_cpu alone does not make it a CPU run
    assert texts(preflight.findings(PreflightConfig(allow_cpu=True), facts)) == [fail]
    assert fail.endswith("or hide it (CUDA_VISIBLE_DEVICES=) and pass --allow_cpu to train on the CPU")


def test_an_old_driver_that_cuda_still_initialises_on_is_a_warning():
    """CUDA's forward-compatibility package (datacenter GPUs) runs a newer CUDA on an older driver: never blocked."""
    found = preflight.gpu_findings(PreflightConfig(), good_facts(smi=SMI["old_driver"][0]))
    assert levels(found) == ["warn", "ok"] and "yet CUDA initialises" in found[0].text


def test_mig_says_what_it_means_for_the_run():
    mig = good_facts(smi=SMI["mig"][0], smi_list=SMI["mig"][1])
    [warn] = texts(preflight.findings(PreflightConfig(), mig), "warn")
    assert warn.startswith("MIG is on: this run gets one MIG device (3g.20gb), a slice of the NVIDIA A100-SXM4-40GB")
    [fail] = texts(preflight.findings(PreflightConfig(nproc=2), mig))
    assert "each process can use one MIG device" in fail and "--nproc 2" in fail and one_sentence(fail)
    empty = good_facts(smi=SMI["mig_no_instances"][0], smi_list=SMI["mig_no_instances"][1], cuda_available=False)
    [fail] = texts(preflight.findings(PreflightConfig(), empty))  # the reason CUDA sees nothing, not a guess
    assert "has no MIG instances" in fail and "nvidia-smi mig -cgi" in fail and one_sentence(fail)
    assert levels(preflight.gpu_findings(PreflightConfig(allow_cpu=True), empty)) == ["warn"]


def test_shm_and_unwritable_directories():
    assert preflight.shm_findings(PreflightConfig(), 8 << 30, True) == []
    assert preflight.shm_findings(PreflightConfig(), None, True) == []  # no /dev/shm (macOS): nothing uses it
    [warn] = preflight.shm_findings(PreflightConfig(), 64 << 20, True)
    assert warn.level == "warn" and warn.text.startswith("/dev/shm is 64 MB") and "--shm-size 8g" in warn.text
    [fail] = preflight.shm_findings(PreflightConfig(nproc=4), 64 << 20, True)
    assert fail.level == "fail" and "NCCL between 4 processes" in fail.text
    [cpu] = preflight.shm_findings(PreflightConfig(nproc=4), 64 << 20, False)
    assert cpu.level == "warn"  # several CPU processes talk over gloo, which does not use /dev/shm
    dirs = (Dir("--output_dir", "/artifacts", True, False), Dir("HF_HOME", "/cache/huggingface", False, False),
            Dir("DPO_KIT_CACHE", "/cache/huggingface/dpo-kit", False, True))
    inside = preflight.dir_findings(Facts(dirs=dirs, user="uid 1234 (gid 1234)", in_container=True))
    assert [x.level for x in inside] == ["fail", "warn"]
    assert inside[0].text == ('--output_dir /artifacts is not writable by uid 1234 (gid 1234): mount a host directory '
                              'you own there (-v "$PWD/artifacts:/artifacts") and run as yourself (--user '
                              '"$(id -u):$(id -g)")')
    assert inside[1].text.startswith("HF_HOME=/cache/huggingface is not writable by uid 1234 (gid 1234), so nothing")
    outside = preflight.dir_findings(Facts(dirs=dirs[:1], user="uid 1234 (gid 1234)"))
    assert outside[0].text.endswith("make it writable (chown or chmod it) or point --output_dir at a directory you own")


def test_writable_probes_the_directory_or_its_nearest_parent(tmp_path):
    assert preflight.writable(str(tmp_path)) and preflight.writable(str(tmp_path / "not" / "yet"))
    assert preflight.is_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and not preflight.is_hub_id(str(tmp_path))
    assert not preflight.is_hub_id("models/SmolLM2-135M-Instruct/x") and not preflight.is_hub_id("random:llama-3-8b")


def test_triton_toolchain_and_its_one_kernel_test():
    on_gpu = PreflightConfig()
    assert texts(preflight.triton_findings(on_gpu, good_facts(triton=None), True), "note") == [
        "Triton is not installed, so its kernels do not run here and its test is skipped"]
    [fail] = texts(preflight.triton_findings(on_gpu, good_facts(cc=None, smoke=None), True))
    assert fail == ("Triton needs a C compiler: install gcc (apt-get install gcc in the image) or set CC to one, or "
                    "train with --no_fused_ops (no Triton kernels)")
    [warn] = texts(preflight.triton_findings(on_gpu, good_facts(cc=None, smoke=None), False), "warn")
    assert warn.startswith("Triton needs a C compiler: ") and warn.endswith("(its kernels run only on a GPU)")
    [fail] = texts(preflight.triton_findings(on_gpu, good_facts(cc=None, cc_env="/opt/cc", smoke=None), True))
    assert "CC=/opt/cc is not one it can run" in fail
    [fail] = texts(preflight.triton_findings(on_gpu, good_facts(python_h=False, python_dev="python3.10-dev"), True))
    assert "install python3.10-dev" in fail
    assert preflight.triton_findings(PreflightConfig(triton=False), good_facts(cc=None), True) == []
    # what the test itself printed, as one sentence
    assert preflight.smoke_problem("RuntimeError: Failed to find C compiler. Please specify via CC environment "
                                   "variable.").startswith("Triton needs a C compiler: ")
    assert "python3.10-dev" in preflight.smoke_problem("fatal error: Python.h: No such file or directory", "python3.10-dev")
    assert "TRITON_CACHE_DIR" in preflight.smoke_problem("PermissionError: [Errno 13] Permission denied: '/home/kit/.triton'")
    other = preflight.smoke_problem("Traceback (most recent call last):\n  File ...\nRuntimeError: PTX JIT failed")
    assert other == "a one-kernel Triton test failed (RuntimeError: PTX JIT failed)"
    # when it runs: on the GPU with a compiler and Python.h, interpreted without a GPU, never without a compiler
    assert preflight.smoke_mode(on_gpu, good_facts(), True) == "cuda"
    assert preflight.smoke_mode(on_gpu, good_facts(), False) == "interpret"
    assert preflight.smoke_mode(on_gpu, good_facts(cc=None), True) is None
    assert preflight.smoke_mode(on_gpu, good_facts(python_h=False), True) is None
    assert preflight.smoke_mode(PreflightConfig(triton=False), good_facts(), True) is None


def test_host_findings_before_docker_run():
    old = "535.183.01, NVIDIA A100-SXM4-80GB, 8.0, Disabled"
    [fail] = preflight.host_findings(True, True, old, "", "13.0")
    assert fail.text.startswith("the host's NVIDIA driver 535.183.01 is too old for the image's PyTorch, a CUDA 13.0 "
                                "build that needs driver 580.65.06 or newer: upgrade the driver to the 580 branch")
    assert preflight.host_findings(True, True, H100, "", "13.0") == []
    assert preflight.host_findings(True, True, old, "", None) == []  # the cpu variant: no CUDA to check
    assert "has no nvidia-smi" in preflight.host_findings(True, True, None, "", "13.0")[0].text
    assert "NVIDIA driver does not answer" in preflight.host_findings(True, True, "", SMI["no_driver"][0], "13.0")[0].text
    [cpu] = preflight.host_findings(False, False, H100, "", "13.0")
    assert "--gpus was not given" in cpu.text and "-- --allow_cpu" in cpu.text
    assert preflight.host_findings(False, True, H100, "", "13.0") == []
    assert preflight.host_findings(False, False, None, "", "13.0") == []  # no GPU host: the CPU is the only choice


def test_every_failure_is_one_sentence():
    """Across the conditions above, each failure's text is one sentence (it is printed as `error: TEXT.`)."""
    configs = [PreflightConfig(), PreflightConfig(require_gpu=True, nproc=2, output_dir="/a")]
    facts = [Facts(), Facts(proc_driver="580.95.05"), Facts(smi="", smi_failed=SMI["no_driver"][0]),
             good_facts(torch_cuda=None), good_facts(smi=SMI["old_driver"][0]), good_facts(cuda_available=False),
             good_facts(smi="580.95.05, Tesla V100, 7.0, [N/A]"), good_facts(smi=SMI["mig"][0], smi_list=SMI["mig"][1]),
             good_facts(smi=SMI["mig_no_instances"][0]), good_facts(cc=None, smoke=None), good_facts(python_h=False),
             good_facts(smoke="RuntimeError: boom"), good_facts(shm_bytes=1 << 20), good_facts(torch=None, torch_error="x"),
             good_facts(dirs=(Dir("--output_dir", "/a", True, False),))]
    seen = 0
    for cfg in configs:
        for f in facts:
            for x in preflight.findings(cfg, f):
                assert one_sentence(x.text) and not x.text.endswith("."), x.text
                seen += x.level == "fail"
    assert seen >= 20


# ---------------------------------------------------------------------------------------------
# End to end: fake nvidia-smi on PATH, `entrypoint.py check` in a child process.
# ---------------------------------------------------------------------------------------------

def fake_bin(tmp_path: Path, condition: str | None) -> Path:
    """A directory holding a fake nvidia-smi that prints what the driver would for `condition` (None: none)."""
    bin_dir = tmp_path / f"bin-{condition}"
    bin_dir.mkdir(parents=True)
    if condition:
        query, listing, status = SMI[condition]
        (bin_dir / "nvidia-smi").write_text(
            "#!/bin/sh\n"
            f"case \"$*\" in\n  *-L*) printf '%s\\n' {shlex.quote(listing)}; exit {status};;\n"
            f"  *) printf '%s\\n' {shlex.quote(query)}; exit {status};;\nesac\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    return bin_dir


def as_cuda_build(available: bool) -> str:
    """Code that makes the child's torch look like the lock's CUDA 13.0 build (this machine has the CPU build),
    with CUDA initialising or not (as it does not on an old driver)."""
    return (f"import torch; torch.version.cuda = '13.0'; torch.cuda.is_available = lambda: {available}; "
            f"torch.cuda.get_arch_list = lambda: {list(CUDA13_ARCHS) if available else []!r}; ")


def check(tmp_path, condition, *args, path_rest=("/usr/bin", "/bin"), cuda_build=None, env=None):
    """`entrypoint.py check ARGS` with the fake nvidia-smi first on PATH. cuda_build: None = this machine's torch,
    True/False = the CUDA build with CUDA available or not."""
    path = os.pathsep.join([str(fake_bin(tmp_path, condition)), *path_rest])
    args = [*args, *(["--no_bitsandbytes"] if cuda_build is not None else [])]  # it would believe the fake CUDA too
    code = (("" if cuda_build is None else as_cuda_build(cuda_build)) +
            f"import sys, entrypoint; from dpokit.core import kit; sys.exit(kit.run_cli(entrypoint.main, ['check', *{args!r}]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={**os.environ, "PATH": path, **(env or {})})
    assert "Traceback" not in out.stdout + out.stderr, out.stderr
    errors = out.stderr.strip().splitlines()
    assert all(line.startswith("error: ") and one_sentence(line) for line in errors), errors
    return out.returncode, out.stdout, [line[len("error: "):] for line in errors]


def test_check_with_a_good_gpu_but_this_machines_cpu_build_of_torch(tmp_path):
    if preflight.torch_facts(False, False).get("torch_cuda"):
        pytest.skip("torch here is a CUDA build")
    code, out, errors = check(tmp_path, "good")
    assert code == 1 and "GPU 0: NVIDIA H100 80GB HBM3, driver 580.95.05, compute capability 9.0, MIG Disabled" in out
    assert errors == [f"an NVIDIA GPU is here (NVIDIA H100 80GB HBM3, driver 580.95.05) but PyTorch "
                      f"{preflight.torch_facts(False, False)['torch']} is its CPU build: install the CUDA build (make "
                      "distclean venv on this machine, or train in the image: RUNNER=docker), or pass --allow_cpu to "
                      "train on the CPU."]
    code, out, errors = check(tmp_path / "a", "good", "--allow_cpu")
    assert code == 0 and errors == [] and "training runs on the CPU (--allow_cpu)" in out


def test_check_with_the_cuda_build_on_each_fake_condition(tmp_path):
    code, out, errors = check(tmp_path, "good", "--require_gpu", "--nproc", "8", cuda_build=True)
    assert code == 0 and errors == [] and "1 GPU(s) usable by PyTorch" in out
    code, out, errors = check(tmp_path / "old", "old_driver", cuda_build=False)
    assert code == 1 and len(errors) == 1 and errors[0].startswith("the NVIDIA driver 535.183.01 is too old for PyTorch")
    assert "upgrade the driver to the 580 branch or newer" in errors[0]
    code, out, errors = check(tmp_path / "nodrv", "no_driver", "--require_gpu", cuda_build=False)
    assert code == 1 and errors == [
        "nvidia-smi is here but the NVIDIA driver does not answer (NVIDIA-SMI has failed because it couldn't "
        "communicate with the NVIDIA driver): load the driver (reboot after installing or upgrading it)."]
    code, out, errors = check(tmp_path / "nodev", "no_devices", cuda_build=False)
    assert code == 1 and errors[0].startswith("nvidia-smi finds no GPU: start the container with --gpus all")
    code, out, errors = check(tmp_path / "mig", "mig", cuda_build=True)
    assert code == 0 and "[preflight] warning: MIG is on: this run gets one MIG device (3g.20gb)" in out
    code, out, errors = check(tmp_path / "mig2", "mig", "--nproc", "2", cuda_build=True)
    assert code == 1 and len(errors) == 1 and "MIG is on (2 MIG device(s): 3g.20gb, 3g.20gb)" in errors[0]
    code, out, errors = check(tmp_path / "mig0", "mig_no_instances", cuda_build=False)
    assert code == 1 and "no MIG instances" in errors[0]


def fake_triton(tmp_path: Path, jit_error: str = "") -> Path:
    """A `triton` package (with its dist-info) whose jit raises jit_error: what the real one raises without a
    compiler, reached on a machine that has no GPU to compile for."""
    site = tmp_path / "site"
    (site / "triton").mkdir(parents=True)
    launch = "    return type('Kernel', (), {'__getitem__': lambda self, grid: lambda x, n, BLOCK: x.add_(1)})()\n"
    (site / "triton" / "__init__.py").write_text(
        "def jit(fn):\n" + (f"    raise RuntimeError({jit_error!r})\n" if jit_error else launch))
    (site / "triton" / "language.py").write_text("constexpr = int\n")
    (site / "triton-3.7.1.dist-info").mkdir()
    (site / "triton-3.7.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: triton\nVersion: 3.7.1\n")
    return site


def test_check_without_a_c_compiler(tmp_path):
    """PATH without gcc and clang (and no CC): on a GPU a failure naming the fix, on the CPU a warning."""
    site = fake_triton(tmp_path)
    env = {"PYTHONPATH": str(site), "CC": ""}
    code, out, errors = check(tmp_path, "good", path_rest=(), cuda_build=True, env=env)
    assert code == 1 and errors == ["Triton needs a C compiler: install gcc (apt-get install gcc in the image) or set "
                                    "CC to one, or train with --no_fused_ops (no Triton kernels)."]
    code, out, errors = check(tmp_path / "n", "good", "--no_triton", path_rest=(), cuda_build=True, env=env)
    assert code == 0 and "Triton" not in out  # --no_fused_ops runs: no Triton kernels, nothing to test
    code, out, errors = check(tmp_path / "cpu", None, path_rest=(), env=env)
    assert code == 0 and "[preflight] warning: Triton needs a C compiler: " in out


def test_check_reports_what_tritons_one_kernel_test_printed(tmp_path):
    """A compiler on PATH that Triton still cannot use: the test's own error, as one sentence."""
    if not Path("/usr/bin/gcc").exists() and not Path("/usr/bin/clang").exists():
        pytest.skip("no compiler here for the pre-check to find")
    site = fake_triton(tmp_path, "Failed to find C compiler. Please specify via CC environment variable.")
    code, out, errors = check(tmp_path, "good", cuda_build=True, env={"PYTHONPATH": str(site), "CC": ""})
    assert code == 1 and errors == ["Triton needs a C compiler: install gcc (apt-get install gcc in the image) or set "
                                    "CC to one, or train with --no_fused_ops (no Triton kernels)."]
    site_ok = fake_triton(tmp_path / "ok")
    code, out, errors = check(tmp_path / "ok", None, env={"PYTHONPATH": str(site_ok), "CC": ""})
    assert code == 0 and "Triton 3.7.1: a one-kernel test ran under Triton's interpreter (no GPU here)" in out


def test_train_stops_on_a_gpu_machine_unless_allow_cpu(tmp_path):
    """train_dpo.py's pre-flight, before anything loads: a GPU that this PyTorch (the CPU build) cannot use."""
    if preflight.torch_facts(False, False).get("torch_cuda"):
        pytest.skip("torch here is a CUDA build")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": "2+2=", "chosen": " 4", "rejected": " 5"}\n')
    path = os.pathsep.join([str(fake_bin(tmp_path, "good")), "/usr/bin", "/bin"])
    out = subprocess.run([sys.executable, str(ROOT / "train_dpo.py"), "--data", str(pairs), "--output_dir",
                          str(tmp_path / "a")], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={**os.environ, "PATH": path})
    assert out.returncode == 1 and "Traceback" not in out.stderr
    [line] = out.stderr.strip().splitlines()
    assert line.startswith("error: an NVIDIA GPU is here (NVIDIA H100 80GB HBM3, driver 580.95.05)")
    assert line.endswith("or pass --allow_cpu to train on the CPU.") and not (tmp_path / "a").exists()


def test_launcher_checks_the_hosts_driver_before_any_engine(tmp_path):
    def launcher(condition, *args):
        path = os.pathsep.join([str(fake_bin(tmp_path / "_".join(args), condition)), "/usr/bin", "/bin"])
        return subprocess.run([sys.executable, str(ROOT / "launcher.py"), *args, "--output_dir", str(tmp_path / "out"),
                               "--hf_cache", str(tmp_path / "hf")], capture_output=True, text=True, cwd=ROOT,
                              timeout=120, env={**os.environ, "PATH": path, "DOCKER_HOST": ""})

    out = launcher("old_driver", "check", "--gpus", "all")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip() == (
        "error: the host's NVIDIA driver 535.183.01 is too old for the image's PyTorch, a CUDA 13.0 build that needs "
        "driver 580.65.06 or newer: upgrade the driver to the 580 branch or newer (the GPU VM's driver image, or sudo "
        "apt-get install nvidia-driver-580-server, then reboot).")
    out = launcher("good", "train", "--data", str(ROOT / "data" / "runs.jsonl"))
    assert out.returncode == 1 and "--gpus was not given" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    out = launcher(None, "check", "--gpus", "all")
    assert out.returncode == 1 and out.stderr.startswith("error: --gpus was given but this host has no nvidia-smi")
