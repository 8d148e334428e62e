"""The native step on every CPU and compiler qkv builds for, checked by its own C-level tests
(tests/kernels/c/test_step.c: the tiled step's forward and backward of one call against float64
references, float32 and half-precision inputs, head dims on and off the vectors, masks and
modifications, and its row dots (the backward's Delta); tests/kernels/c/test_paged.c: the
paged decode step's vector item over float32, bfloat16, int8 and float8 pages), with no
Python in between:

- in the default run, for the steps of this machine's CPU (x86-64: AVX-512 and AVX2);
- ``-m aarch64``: cross-compiled for ARM64 with Debian's aarch64 gcc and run under
  qemu-user (the NEON steps, and the SVE steps on a CPU with 256-bit SVE vectors), and both
  extensions compiled for ARM64;
- ``-m toolchains``: the extensions built with clang, and without OpenMP (single-threaded),
  each imported and checked against the default build.

Missing tools are installed with apt-get where this user may (root, or sudo without a
password); else the test fails naming what to install. CI runs all three.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "src/qkv/kernels"
TILED = KERNELS / "tiled"
#: each C test, the sources it links per instruction set, its cases per step, and its
#: cases per step run in the CPU's bfloat16 dot products (test_step: its bfloat16 cases, on
#: every step where the CPU has them; test_paged: AVX-512's item for bfloat16 queries)
TESTS = {
    "test_step": (
        {
            512: ["tiled/_step512.c", "tiled/_step512_rows16.c"],
            256: ["tiled/_step256.c", "tiled/_step256_rows2.c"],
            128: ["tiled/_step128.c", "tiled/_step128_rows2.c"],
            257: ["tiled/_step_sve.c", "tiled/_step_sve_rows2.c"],
        },
        51,
        13,
    ),
    "test_paged": (
        {
            512: ["_paged512.c", "_paged512_dots.c"],
            256: ["_paged256.c"],
            128: ["_paged128.c"],
            257: ["_paged_sve.c"],
        },
        80,
        80,
    ),
}


#: what setup.py's sve_flags gives GCC for ARM64: the SVE steps built (257 above)
SVE = ["-msve-vector-bits=256", "-DQKV_SVE=1"]


def install(package: str) -> None:
    """Debian's ``package`` installed with apt-get where this user may (root, or sudo
    without a password); nothing where not."""
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    if not shutil.which("apt-get") or (sudo and not shutil.which("sudo")):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    get = [*sudo, "apt-get", "install", "-y", "-q", package]
    if subprocess.run(get, env=env, capture_output=True, timeout=900).returncode:
        subprocess.run([*sudo, "apt-get", "update", "-q"], env=env, capture_output=True)
        subprocess.run(get, env=env, capture_output=True, timeout=900)


def tool(name: str, package: str) -> str:
    """The path of ``name``, installing ``package`` first if it is missing."""
    if not shutil.which(name):
        install(package)
    found = shutil.which(name)
    if not found:
        pytest.fail(f"{name} is missing and could not be installed: apt-get install {package}")
    return found


def built(cc: str, test: str, isas: tuple[int, ...], exe: Path, *flags: str) -> Path:
    """The C test ``test`` linked with its sources for ``isas``, by ``cc``."""
    per_isa = TESTS[test][0]
    kernels = (KERNELS / s for isa in isas for s in per_isa[isa])
    sources = [ROOT / "tests" / "kernels" / "c" / f"{test}.c", *kernels]
    # the paged items fold their sums every 32 keys (2,048 when built by setup.py) and the
    # vector items take pages 16 keys at a time (256), so that test_paged's sequences of 37
    # and 80 keys in pages of 32 take two and three folds, each page in two parts
    paged = ("-DFOLD_KEYS=32", "-DPAGE_PART=16")
    flags = (*flags, *paged) if test == "test_paged" else flags
    subprocess.run([cc, "-O2", *flags, *map(str, sources), "-lm", "-o", str(exe)], check=True)
    return exe


def run_c_test(cmd: list[str], test: str, steps: int, dot_steps: int = 0) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    cases = TESTS[test][1] * steps + TESTS[test][2] * dot_steps
    assert f"{cases} of {cases} cases within tolerance" in done.stdout
    return done.stdout


@pytest.mark.parametrize("test", list(TESTS))
def test_the_steps_of_this_cpu_match_float64(test, tmp_path):
    """The tiled step and the paged decode step, on AVX-512 and AVX2 where the CPU has them."""
    if sys.platform != "linux" or os.uname().machine != "x86_64" or not shutil.which("cc"):
        pytest.skip("built here for x86-64 Linux with the system C compiler")
    exe = built("cc", test, (512, 256), tmp_path / test)
    flags = Path("/proc/cpuinfo").read_text()
    # a step per source of the tiled step (two blockings each); one paged item per set
    avx512, avx2 = (len(TESTS[test][0][isa]) if test == "test_step" else 1 for isa in (512, 256))
    steps = ("avx512f" in flags) * avx512 + ("avx2" in flags) * avx2
    dots = "avx512f" in flags and "avx512_bf16" in flags
    out = run_c_test([str(exe)], test, steps, dots * avx512)
    assert ("avx2 " in out) == ("avx2" in flags)


@pytest.mark.aarch64
@pytest.mark.parametrize("test", list(TESTS))
@pytest.mark.parametrize(
    "cpu",
    ["max,sve256=on", "max,sve128=on", "cortex-a72"],
    ids=["sve256-bf16", "sve128-bf16", "neon-only"],
)
def test_the_arm64_steps_match_float64_under_qemu(test, cpu, tmp_path):
    """The tiled step and the paged decode step for ARM64, built as setup.py builds them
    with GCC (NEON and SVE), run under qemu-user: on qemu's fullest CPU with 256-bit SVE
    vectors (the SVE steps run beside NEON's, bfloat16 in both one's BFDOT), with 128-bit
    ones (the SVE steps are for 256 bits: NEON's alone run), and on a Cortex-A72, which has
    neither SVE nor BFDOT (the steps must not use them there: they would die of SIGILL)."""
    gcc = tool("aarch64-linux-gnu-gcc", "gcc-aarch64-linux-gnu")
    qemu = tool("qemu-aarch64", "qemu-user")
    exe = built(gcc, test, (128, 257), tmp_path / f"{test}_arm64", "-static", *SVE)
    sve = "sve256" in cpu
    steps = len(TESTS[test][0][128]) + sve * len(TESTS[test][0][257])
    dot_steps = steps if cpu != "cortex-a72" and test == "test_step" else 0  # (no paged item)
    out = run_c_test([qemu, "-cpu", cpu, str(exe)], test, steps, dot_steps)
    assert "neon" in out
    assert (" sve" in out) == sve


@pytest.mark.aarch64
@pytest.mark.parametrize("openmp", [True, False], ids=["openmp-sve", "single-threaded-neon"])
def test_both_extensions_compile_for_arm64(openmp, tmp_path):
    """The modules themselves (Python's headers are the same on both 64-bit targets),
    compiled with every warning as an error: with OpenMP and the SVE steps, and without
    either (what a compiler that has neither builds: NEON alone, one thread)."""
    gcc = tool("aarch64-linux-gnu-gcc", "gcc-aarch64-linux-gnu")
    include = sysconfig.get_paths()["include"]
    sources = [
        TILED / "_native.c",
        TILED / "_step128.c",
        TILED / "_step128_rows2.c",
        TILED / "_step_sve.c",
        TILED / "_step_sve_rows2.c",
        KERNELS / "_paged.c",
        KERNELS / "_paged128.c",
        KERNELS / "_paged_sve.c",
    ]
    for source in sources:
        cmd = [gcc, "-O2", "-Wall", "-Werror", "-fPIC", f"-I{include}", "-c", str(source)]
        cmd += ["-fopenmp", *SVE] if openmp else ["-Wno-unknown-pragmas"]
        done = subprocess.run(
            [*cmd, "-o", str(tmp_path / f"{source.stem}.o")], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr


def build(tmp_path: Path, **env: str) -> Path:
    """The extensions built in a copy of the sources with ``env``; the copy's src path."""
    for name in ("src", "setup.py", "pyproject.toml", "README.md", "LICENSE"):
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(ROOT / name, tmp_path / name)
    for product in [*(tmp_path / "src").rglob("*.so"), *(tmp_path / "src").rglob("_built.py")]:
        product.unlink()  # an in-place build's, copied with the sources (once, a build that
        # failed left them in place and its test ran them: clang 14 failed unseen)
    done = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace", "-q"],
        cwd=tmp_path,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp_path / "src"


def run_against(src: Path, code: str) -> subprocess.CompletedProcess:
    """``code`` run by a fresh Python that imports qkv from the build in ``src``; it must
    exit 0."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(src)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_a_kernel_that_fails_to_build_is_named_when_qkv_runs(tmp_path):
    """pip hides a build's output, and the kernels are optional: a compiler that fails
    leaves an install that works on its PyTorch paths and says so, once, with the reason."""
    src = build(tmp_path, CC="false")
    assert not list(src.rglob("*.so"))
    check = (
        "import torch, qkv; from qkv.kernels import built; "
        "print(sorted(built.failed())); "
        "q = torch.randn(1, 2, 300, 32); "
        "print(qkv.dispatch(q, q, q, mask=qkv.masks.sliding_window(8), backend='tiled').path); "
        "qkv.attention(q, q, q, mask=qkv.masks.sliding_window(8), backend='tiled')"
    )
    done = run_against(src, check)
    names, path = done.stdout.split("\n")[:2]
    assert names == "['qkv.kernels._paged', 'qkv.kernels.tiled._native']"
    assert path == "tiled-flash"
    assert done.stderr.count("qkv's C kernels did not build at install") == 1, done.stderr
    assert "the C compiler 'false' failed (exit status 1)" in done.stderr


CHECK = """
import torch, qkv
from qkv.kernels import paged
from qkv.kernels.tiled import steps
assert steps.available(torch.float32) and paged.available(), "not built"
print(steps.openmp())
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 4, 300, 48, generator=g).requires_grad_() for _ in range(3))
mask = qkv.masks.sliding_window(40)
# whether this build runs natively, not whether the probe finds it faster here (a build
# without OpenMP runs one thread against torch's two)
with qkv.tuned(native_probe=False):
    assert qkv.dispatch(q, k, v, mask=mask, backend="tiled").path == "tiled-native"
    out = qkv.attention(q, k, v, mask=mask, backend="tiled")
grads = torch.autograd.grad(out.sum(), (q, k, v))
want = qkv.attention(*(x.double() for x in (q, k, v)), mask=mask, backend="reference")
wg = torch.autograd.grad(want.sum(), (q, k, v))
assert (out - want).abs().max() < 1e-5, (out - want).abs().max()
assert all((a - b).abs().max() < 1e-4 for a, b in zip(grads, wg))
"""


@pytest.mark.toolchains
@pytest.mark.parametrize(
    "env,openmp",
    [({"CC": "clang"}, True), ({"QKV_OPENMP": "0"}, False)],
    ids=["clang", "without-openmp"],
)
def test_the_extensions_build_with_clang_and_without_openmp(env, openmp, tmp_path):
    """Each build imports, runs a window forward and backward natively within float32's
    rounding of the float64 reference, and says whether it has OpenMP threads."""
    if env.get("CC") == "clang":
        clang = tool("clang", "clang")
        probe = tmp_path / "omp.c"
        probe.write_text("#include <omp.h>\nint main(void) { return omp_get_max_threads() < 1; }\n")
        omp = [clang, "-fopenmp", str(probe), "-o", str(tmp_path / "omp")]
        if subprocess.run(omp, capture_output=True).returncode:
            install("libomp-dev")  # clang's OpenMP runtime
        if subprocess.run(omp, capture_output=True).returncode:
            pytest.fail("clang has no OpenMP: apt-get install libomp-dev")
    done = run_against(build(tmp_path, **env), CHECK)
    assert done.stdout.split() == [str(openmp)]
