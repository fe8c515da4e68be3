"""deploy/smoke.sh's parts that need no Docker engine, run in bash from its own functions (the
script only defines them when sourced): the Debian mirror found in apt sources of every format,
the torch wheel found in find-links folders named more than once, and the error trap that makes
every early exit say which step and which command failed."""

from __future__ import annotations

import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SMOKE = ROOT / "deploy" / "smoke.sh"


def bash(script: str, cwd: pathlib.Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f"source {SMOKE}\n{script}"], cwd=cwd, capture_output=True, text=True,
                          timeout=60)


def mirror(apt: pathlib.Path) -> str:
    out = bash(f"set -euo pipefail; debian_mirror {apt}")
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def write(path: pathlib.Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_sourcing_the_script_runs_nothing(tmp_path):
    out = bash("pwd; type main >/dev/null && echo defined", cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.split() == [str(tmp_path), "defined"] and not out.stderr


def test_mirror_from_a_one_line_sources_list(tmp_path):
    write(tmp_path / "sources.list", """\
# deb http://commented.example/debian bookworm main
deb http://security.example/debian-security bookworm-security main
deb [arch=amd64 signed-by=/usr/share/keyrings/debian.gpg] http://mirror.example/debian bookworm main  # a comment
deb http://later.example/debian bookworm main
""")
    assert mirror(tmp_path) == "http://mirror.example/debian"


def test_mirror_from_sources_list_d_without_sources_list(tmp_path):
    write(tmp_path / "sources.list.d" / "vendor.list", "deb [ trusted=yes ] https://vendor.example/apt stable main\n")
    write(tmp_path / "sources.list.d" / "debian.list", "  #deb http://old.example/debian bullseye main\n"
          "deb https://mirror.example/debian/ bookworm main contrib\n")
    assert mirror(tmp_path) == "https://mirror.example/debian/"


def test_mirror_from_deb822_sources(tmp_path):
    write(tmp_path / "sources.list.d" / "debian.sources", """\
# URIs: http://commented.example/debian
Types: deb
URIs: http://disabled.example/debian
Suites: bookworm
Enabled: no

Types: deb deb-src
URIs: http://security.example/debian-security http://mirror.example/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
""")
    assert mirror(tmp_path) == "http://mirror.example/debian"


def test_mirror_defaults_to_deb_debian_org(tmp_path):
    write(tmp_path / "sources.list.d" / "other.sources", "Types: deb\nURIs: http://vendor.example/apt\n")
    assert mirror(tmp_path) == "http://deb.debian.org/debian"
    assert mirror(tmp_path / "absent") == "http://deb.debian.org/debian"


def test_the_wheel_is_found_in_a_folder_named_twice(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for i in range(3000):  # enough that `ls | head -1` under pipefail would die of SIGPIPE
        (wheels / f"pkg{i:04d}-1.0-py3-none-any.whl").touch()
    (wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").touch()
    out = bash(f"set -euo pipefail; find_wheel 'torch-2.13.0+cpu-*.whl' {tmp_path}/empty {wheels} {wheels}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [str(wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")]
    out = bash(f"set -euo pipefail; find_wheel 'pkg*.whl' {wheels} {wheels} | wc -l")
    assert out.stdout.strip() == "1"
    out = bash(f"set -euo pipefail; find_wheel 'torch-*.whl' {tmp_path}/empty; echo status=$?")
    assert out.returncode == 1 and out.stdout == "", "no wheel: status 1, which set -e turns into an exit"
    # The folders pip reads: the environment's first (this machine names /opt/wheels there and in pip's config).
    out = bash(f"PIP_FIND_LINKS={wheels} pip_find_links")
    assert out.returncode == 0 and out.stdout.split()[0] == str(wheels), out


@pytest.mark.parametrize("where", ["script", "function"])
def test_a_failing_command_names_its_step_command_and_output(tmp_path, where):
    log = tmp_path / "step.log"
    body = f'step "copy the CA bundle" {log}\necho "what the step printed" >>"$SMOKE_STEP_LOG"\n' \
           "cp /nonexistent/ca.crt /nonexistent/etc/ssl/host-ca.crt\necho not reached"
    script = f"copy() {{\n{body}\n}}\ninstall_traps\ncopy" if where == "function" else f"install_traps\n{body}"
    out = bash(script)
    assert out.returncode == 1 and "not reached" not in out.stdout
    assert "FAILED in step 'copy the CA bundle'" in out.stderr, out.stderr
    assert "`cp /nonexistent/ca.crt /nonexistent/etc/ssl/host-ca.crt` exited with status 1" in out.stderr
    assert "No such file or directory" in out.stderr  # the command's own error
    assert "what the step printed" in out.stderr  # the end of the step's log


def test_exits_the_error_trap_cannot_see_are_reported(tmp_path):
    out = bash('install_traps\nstep "read the settings"\necho "$UNSET_SETTING"')
    assert out.returncode != 0
    assert "FAILED in step 'read the settings': exited with status" in out.stderr, out.stderr


def test_a_dying_pipeline_is_reported_not_silent():
    # What ended the script silently with status 141 before: a reader that stops early, under pipefail.
    out = bash('install_traps\nstep "list wheels"\nyes | head -1 >/dev/null')
    assert out.returncode == 141
    assert "FAILED in step 'list wheels'" in out.stderr and "status 141" in out.stderr, out.stderr


def test_timed_steps_report_the_command_not_its_wrapper():
    out = bash('install_traps\nTIMINGS=()\nstep "build"\ntimed "build" ls /nonexistent-build-context')
    assert out.returncode == 2
    assert "`ls /nonexistent-build-context` exited with status 2" in out.stderr, out.stderr
