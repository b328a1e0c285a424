"""The Dockerfile's own checks, run without a container engine.

What its stages COPY from the build context (.dockerignore honoured: no prebuilt
extension) goes under a temporary root, atoll is installed with the build stage's
`pip install --no-deps .` into a fresh venv at <root>/opt/atoll, and then every command
the RUNs chain, read from the Dockerfile, runs here in its WORKDIR: a new check runs
here too, and a rename fails a test rather than an image build.

Not run, each for the reason NOT_RUN gives: the toolchain's apt-get and venv, the
dependency installs (the fresh venv sees this .venv's site-packages for its
dependencies, atoll's own files left out: nothing is downloaded), and
`import libtpu`, which installs only on TPU hosts; so the TPU image is checked for
everything but libtpu. The install builds with this .venv's setuptools
(--no-build-isolation, no index) rather than those pip would fetch for the image.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import shlex
import subprocess
import sys
import sysconfig

import dockerfile
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
STAGES = dockerfile.stages(REPO / "Dockerfile")
VENV = "/opt/atoll"
INSTALL = f"{VENV}/bin/pip install --no-deps ."
BUILDS = ("build", "build-tpu")  # the stages that install atoll: CPU image, TPU image

# The commands the image runs that this test does not, and why; every other one runs.
NOT_RUN = {
    r"apt-get .*|rm -rf /var/lib/apt/lists/\*": "the compiler: this host's gcc builds here",
    rf"python -m venv {VENV}": "the fixture makes the venv, under its temporary root",
    rf"{VENV}/bin/pip install -r .*": "dependencies: the venv sees this .venv's",
    re.escape(INSTALL): "the fixture runs it once: both builds install the same sources",
    rf'{VENV}/bin/python -c "import libtpu"': "libtpu installs only on TPU hosts",
    r"(groupadd|useradd) .*": "the runtime stages' user: needs root, checks nothing built",
}


def _runs_here(command: dockerfile.Command) -> bool:
    return not any(re.fullmatch(p, " ".join(command.text.split())) for p in NOT_RUN)


COMMANDS = [(s, c) for s in STAGES.values() for c in s.runs() if _runs_here(c)]


@dataclasses.dataclass
class Image:
    root: pathlib.Path  # the image's / here
    site: pathlib.Path  # the fresh venv's site-packages
    copied: list[str]  # what the COPYs took from the build context

    def python(self, code: str) -> str:
        """Runs code on the fresh venv's interpreter from the root; returns its stdout."""
        python = self.root / VENV.lstrip("/") / "bin/python"
        return subprocess.run(
            [python, "-c", code], cwd=self.root, capture_output=True, text=True, check=True
        ).stdout


def _run(
    root: pathlib.Path, stage: dockerfile.Stage, command: dockerfile.Command
) -> subprocess.CompletedProcess[str]:
    """Runs one RUN command of `stage` as the image build would, on root's tree."""
    env = {
        **stage.env,
        "PATH": f"{root}/usr/local/bin:/usr/bin:/bin",
        "HOME": str(root / "root"),
        "LANG": "C.UTF-8",
    }
    return subprocess.run(
        ["sh", "-c", command.text.replace(VENV, f"{root}{VENV}")],
        cwd=root / command.workdir.lstrip("/"),
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def _copy(root: pathlib.Path, copy: dockerfile.Instruction) -> list[str]:
    *sources, dest = shlex.split(copy.args)
    if sources[0].startswith("--from="):
        # Every stage shares root's tree, so a copy of one path between stages is done.
        assert sources[1:] == [dest], f"COPY {copy.args}: only the same path across stages"
        return []
    into = dest.endswith("/") or len(sources) > 1
    target = root / pathlib.PurePosixPath(copy.workdir, dest).as_posix().lstrip("/")
    return dockerfile.copy_context(REPO, sources, target, into=into)


def _dependency_links(target: pathlib.Path) -> None:
    """Links everything in this interpreter's site-packages but atoll into target: the
    fresh venv's dependencies, without the editable install or its import hook."""
    target.mkdir()
    for folder in {pathlib.Path(sysconfig.get_path(k)) for k in ("purelib", "platlib")}:
        for entry in folder.iterdir():
            name = entry.name
            if name.startswith(("atoll", "__editable__", "__pycache__")) or name.endswith(".pth"):
                continue
            if not (target / name).exists():
                (target / name).symlink_to(entry)


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Image:
    """The image's tree under a temporary root, atoll installed as its build stage does."""
    root = tmp_path_factory.mktemp("image")
    (root / "root").mkdir()
    (root / "usr/local/bin").mkdir(parents=True)
    # The base image's `python`: the interpreter under this .venv, not the .venv's.
    (root / "usr/local/bin/python").symlink_to(sys._base_executable)
    copied = [
        path
        for stage in STAGES.values()
        for ins in stage.instructions
        if ins.keyword == "COPY"
        for path in _copy(root, ins)
    ]

    venv = root / VENV.lstrip("/")
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", venv], check=True)
    _dependency_links(root / "deps")
    (site,) = venv.glob("lib/python*/site-packages")
    # A path line only extends sys.path: the .pth files in that folder are never read.
    (site / "deps.pth").write_text(f"{root / 'deps'}\n")
    (venv / "bin/pip").write_text('#!/bin/sh\nexec "$(dirname "$0")/python" -m pip "$@"\n')
    (venv / "bin/pip").chmod(0o755)

    installs = [[c for c in STAGES[name].runs() if c.text == INSTALL] for name in BUILDS]
    assert all(installs), f"stages {BUILDS} each run `{INSTALL}`"
    offline = f"PIP_NO_INDEX=1 {VENV}/bin/pip install --no-build-isolation --no-deps ."
    done = _run(root, STAGES[BUILDS[0]], dataclasses.replace(installs[0][0], text=offline))
    assert done.returncode == 0, done.stdout + done.stderr
    return Image(root, site, copied)


@pytest.mark.parametrize(
    ("stage", "command"),
    COMMANDS,
    ids=[f"{s.name}-{c.text.split()[0].rsplit('/', 1)[-1]}-line{c.line}" for s, c in COMMANDS],
)
def test_dockerfile_command_runs(
    image: Image, stage: dockerfile.Stage, command: dockerfile.Command
) -> None:
    done = _run(image.root, stage, command)
    assert done.returncode == 0, (
        f"Dockerfile line {command.line}, stage {stage.name}, in {command.workdir}: "
        f"`{command.text}` exited {done.returncode}\n{done.stdout}{done.stderr}"
    )


def test_sources_leave_out_prebuilt_extensions(image: Image) -> None:
    assert "wire/_kernels.c" in image.copied
    assert [p for p in image.copied if p.endswith(".so")] == []


def test_commands_check_the_fresh_install(image: Image) -> None:
    """atoll and its compiled kernels come from the fresh venv, not from this checkout."""
    paths = image.python(
        "import atoll, atoll.wire._kernels as k; print(atoll.__file__, k.__file__)"
    )
    for path in paths.split():
        assert pathlib.Path(path).is_relative_to(image.site), path


def test_requirements_are_the_pyproject_dependencies(image: Image) -> None:
    """The deps stages' one-liners write exactly what the installed atoll requires."""
    for name in ("deps", "deps-tpu"):
        for command in filter(_runs_here, STAGES[name].runs()):
            assert _run(image.root, STAGES[name], command).returncode == 0, command.text
    requires = image.python(
        "import importlib.metadata as m; print(*m.requires('atoll'), sep='\\n')"
    )
    required = [r for r in requires.splitlines() if "extra ==" not in r]
    src = image.root / STAGES["deps"].workdir.lstrip("/")
    assert (src / "requirements.txt").read_text().split() == required
    (jax,) = [r for r in required if r.startswith("jax==")]
    assert (src / "requirements-tpu.txt").read_text().split() == [jax.replace("jax", "jax[tpu]")]


def test_tpu_image_runs_the_cpu_checks() -> None:
    cpu, tpu = ([c.text for c in STAGES[name].runs()] for name in BUILDS)
    assert [c for c in cpu if c not in tpu] == []
