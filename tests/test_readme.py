"""The README, checked against the running service and the code.

The API tour: every curl command in README.md runs as written, with the real `curl`
binary, in README order, against a live `trainyard serve` process over loopback.

- Every fenced ```sh/```bash/```shell/```console block with a curl command in it is a tour
  block. Each of its commands runs in its own `bash`, in one scratch directory, with the
  shell variables earlier commands set (`JOB=$(curl ... | jq -r .id)`), so placeholders are
  filled from earlier answers exactly as a reader's shell fills them. `localhost:8000`
  becomes the live server's port.
- `[VAR=value ...] make run` (re)starts the server with those variables, as `make run` would
  (`trainyard serve` with TRAINYARD_DEMO_MODEL=true unless given; same data directory).
- `curl` is a shell function that runs the real binary with `--max-time` and `--dump-header`
  added, so each request's status is known: it must be 2xx unless the documented output
  shows another status line.
- `#` lines right below a command are its documented output. A JSON value (from the first
  line that starts with `{` or `[`) must match the printed JSON: every key shown is present,
  every value shown is equal; `...` leaves keys out (in a list: more items may follow) and
  `…` stands for any value (inside a string: any text). Every other line must match a
  printed line, in order (`…` again any text, a `...` line is skipped).

No curl example may sit anywhere the tour does not run it: in another kind of block, in
prose, or in a comment.

The configuration table: every field of Settings with its exact variable and its real
default, and nothing else.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAKEFILE = ROOT / "Makefile"
TRAINYARD = str(Path(sys.executable).parent / "trainyard")

SHELL_LANGUAGES = {"sh", "bash", "shell", "console"}
README_ADDRESS = "localhost:8000"
CURL = re.compile(r"(?<![\w.$-])curl(?=\s)")  # `/usr/bin/curl` too, which bypasses the wrapper
FENCE = re.compile(r"^```(\S*)")
HEREDOC = re.compile(r"<<(-?)\s*(['\"]?)([A-Za-z_]\w*)\2")
ASSIGNMENT = re.compile(r"^([A-Za-z_]\w*)=")
MAKE_RUN = re.compile(r"^((?:[A-Za-z_]\w*=\S*\s+)*)make\s+run\s*(?:#.*)?$")
STATUS_LINE = re.compile(r"^HTTP/[\d.]+ (\d{3})\b")

CURL_MAX_SECONDS = 60  # added to every curl: an event stream that never ends fails the test
COMMAND_TIMEOUT = 90.0
START_TIMEOUT = 120.0


class ReadmeError(AssertionError):
    """The README breaks a rule the tour depends on."""


# --------------------------------------------------------------------------- parsing


@dataclass
class Block:
    language: str
    line: int  # README line of the opening fence
    lines: list[str]


@dataclass
class Command:
    text: str
    line: int  # README line where the command starts
    output: list[str] = field(default_factory=list)

    @property
    def curls(self) -> int:
        return len(CURL.findall(self.text))


def fenced_blocks(text: str) -> list[Block]:
    blocks: list[Block] = []
    current: Block | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        match = FENCE.match(line.strip())
        if current is None:
            if match:
                current = Block(language=match.group(1).lower(), line=number, lines=[])
        elif line.strip() == "```":
            blocks.append(current)
            current = None
        else:
            current.lines.append(line)
    if current is not None:
        raise ReadmeError(f"README.md:{current.line}: the block is never closed")
    return blocks


def _scan(line: str, quote: str | None, depth: int) -> tuple[str | None, int, list[str], bool]:
    """Shell state after one line: the open quote, `(` depth, heredoc words started on it,
    and whether it ends with a line continuation."""
    heredocs: list[str] = []
    i = 0
    while i < len(line):
        char = line[i]
        if quote == "'":
            if char == "'":
                quote = None
        elif quote == '"':
            if char == "\\":
                if i == len(line) - 1:
                    return quote, depth, heredocs, True
                i += 1
            elif char == '"':
                quote = None
        elif char == "\\":
            if i == len(line) - 1:
                return quote, depth, heredocs, True
            i += 1
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            break  # a comment runs to the end of the line
        elif char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char == "<" and (heredoc := HEREDOC.match(line, i)):
            heredocs.append(heredoc.group(3))
            i = heredoc.end()
            continue
        i += 1
    return quote, depth, heredocs, False


def split_commands(block: Block) -> list[Command]:
    """A shell block's logical commands (continuations, multi-line quotes and heredocs
    joined), each with the documented output below it."""
    console = block.language == "console"
    commands: list[Command] = []
    current: list[str] = []
    start = 0
    quote: str | None = None
    depth = 0
    heredocs: list[str] = []
    continued = False
    last: Command | None = None

    for number, line in enumerate(block.lines, start=block.line + 1):
        if current and heredocs and not (quote or depth or continued):
            current.append(line)  # a heredoc's body, up to its word
            if line.strip() == heredocs[0]:
                heredocs.pop(0)
        elif current:
            current.append(line)
            quote, depth, found, continued = _scan(line, quote, depth)
            heredocs.extend(found)
        else:
            stripped = line.strip()
            if not stripped:
                last = None  # a blank line ends the output of the command above it
                continue
            is_command = stripped.startswith("$ ") if console else not stripped.startswith("#")
            if not is_command:
                if last is None:
                    raise ReadmeError(
                        f"README.md:{number}: a line that is not the output of a command "
                        "above it; put prose outside the block or after the command"
                    )
                output = stripped if console else stripped[1:].removeprefix(" ")
                last.output.append(output)
                continue
            start = number
            line = stripped[2:] if console else line
            current = [line]
            quote, depth, heredocs, continued = _scan(line, None, 0)
        if current and not (quote or depth > 0 or continued or heredocs):
            last = Command(text="\n".join(current), line=start)
            commands.append(last)
            current = []
    if current:
        raise ReadmeError(f"README.md:{start}: the command never ends (quote, `(` or heredoc)")
    return commands


def tour(text: str) -> list[Command]:
    """The commands of every shell block that runs curl, in README order."""
    commands: list[Command] = []
    for block in fenced_blocks(text):
        if block.language in SHELL_LANGUAGES and any(CURL.search(line) for line in block.lines):
            commands.extend(split_commands(block))
    return commands


# --------------------------------------------------------------------------- output

ANY = object()  # `…` as a whole value
MORE = object()  # `...` in a list: more items may follow
_ANY_TEXT = "\x00any"
_MORE_TEXT = "\x00more"
_ELIDED_KEY = "\x00elided"


def parse_pattern(text: str) -> Any:
    """JSON with `...` (elided keys or items) and `…` (any value) as a matchable pattern."""
    out: list[str] = []
    stack: list[str] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char == '"':
            end = i + 1
            while text[end] != '"':
                end += 2 if text[end] == "\\" else 1
            out.append(text[i : end + 1])
            i = end + 1
            continue
        if text.startswith("...", i):
            inside_list = bool(stack) and stack[-1] == "["
            out.append(json.dumps(_MORE_TEXT) if inside_list else f"{json.dumps(_ELIDED_KEY)}: 0")
            i += 3
            continue
        if char == "…":
            out.append(json.dumps(_ANY_TEXT))
        else:
            if char in "{[":
                stack.append(char)
            elif char in "}]":
                stack.pop()
            out.append(char)
        i += 1
    return _markers(json.loads("".join(out)))


def _markers(value: Any) -> Any:
    if value == _ANY_TEXT:
        return ANY
    if isinstance(value, dict):
        return {k: _markers(v) for k, v in value.items() if k != _ELIDED_KEY}
    if isinstance(value, list):
        items = [_markers(v) for v in value if v != _MORE_TEXT]
        if _MORE_TEXT in value:
            assert value[-1] == _MORE_TEXT, "`...` must come last in a list"
            items.append(MORE)
        return items
    return value


def glob(pattern: str) -> re.Pattern[str]:
    return re.compile(".*".join(re.escape(part) for part in pattern.split("…")), re.DOTALL)


def mismatch(pattern: Any, actual: Any, path: str = "$") -> str | None:
    """Why `actual` does not match `pattern`, or None."""
    if pattern is ANY:
        return None
    if isinstance(pattern, dict):
        if not isinstance(actual, dict):
            return f"{path}: expected an object, got {actual!r}"
        for key, sub in pattern.items():
            if key not in actual:
                return f"{path}: no key {key!r} (it has {sorted(actual)})"
            if reason := mismatch(sub, actual[key], f"{path}.{key}"):
                return reason
        return None
    if isinstance(pattern, list):
        more = bool(pattern) and pattern[-1] is MORE
        items = pattern[:-1] if more else pattern
        if not isinstance(actual, list) or not (
            len(actual) >= len(items) if more else len(actual) == len(items)
        ):
            return f"{path}: expected {len(items)}{' or more' if more else ''} items: {actual!r}"
        for index, sub in enumerate(items):
            if reason := mismatch(sub, actual[index], f"{path}[{index}]"):
                return reason
        return None
    if isinstance(pattern, str):
        if isinstance(actual, str) and glob(pattern).fullmatch(actual):
            return None
        return f"{path}: expected {pattern!r}, got {actual!r}"
    if type(pattern) is bool or type(actual) is bool or pattern is None or actual is None:
        return None if pattern is actual else f"{path}: expected {pattern!r}, got {actual!r}"
    return None if pattern == actual else f"{path}: expected {pattern!r}, got {actual!r}"


@dataclass
class Expected:
    status: int | None  # None: any 2xx
    lines: list[str]
    json: Any = None
    has_json: bool = False


def expected(command: Command) -> Expected:
    lines = command.output
    start = next((i for i, line in enumerate(lines) if line.lstrip()[:1] in ("{", "[")), None)
    text_lines = lines if start is None else lines[:start]
    statuses = [int(m.group(1)) for line in text_lines if (m := STATUS_LINE.match(line))]
    result = Expected(status=statuses[0] if statuses else None, lines=text_lines)
    if start is not None:
        try:
            result.json = parse_pattern("\n".join(lines[start:]))
        except (ValueError, IndexError, AssertionError) as exc:
            raise ReadmeError(
                f"README.md:{command.line}: the documented JSON does not parse: {exc}"
            ) from exc
        result.has_json = True
    return result


def check_output(command: Command, stdout: str) -> None:
    want = expected(command)
    where = f"README.md:{command.line}: `{command.text.splitlines()[0]}`"
    if command.output and not stdout.strip():
        raise AssertionError(f"{where} printed nothing, but the README shows output")
    printed = stdout.replace("\r\n", "\n").split("\n")
    position = 0
    for line in want.lines:
        if line.strip() == "...":
            continue
        regex = glob(line)
        while position < len(printed) and not regex.fullmatch(printed[position]):
            position += 1
        if position == len(printed):
            raise AssertionError(f"{where}: no line {line!r} (in order) in:\n{stdout}")
        position += 1
    if want.has_json:
        body = stdout.replace("\r\n", "\n")
        if body.startswith("HTTP/"):
            body = body.partition("\n\n")[2]
        try:
            actual = json.loads(body)
        except ValueError:
            raise AssertionError(f"{where}: the README shows JSON, it printed:\n{stdout}") from None
        if reason := mismatch(want.json, actual):
            raise AssertionError(f"{where}: {reason}\nprinted:\n{stdout}")


# --------------------------------------------------------------------------- the server


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Server:
    """`trainyard serve` in a subprocess, as `make run` starts it."""

    def __init__(self, data_dir: Path, log: Path) -> None:
        self.data_dir = data_dir
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.auth: dict[str, str] = {}

    def start(
        self, variables: dict[str, str], *, demo_served: bool = False, port: int | None = None
    ) -> None:
        """Start (again: `stop` first); on `port` (the last one's, say) or a free one."""
        self.stop()
        self.port = port or free_port()
        env = {k: v for k, v in os.environ.items() if not k.upper().startswith("TRAINYARD_")}
        env.update(
            TRAINYARD_DATA_DIR=str(self.data_dir),
            TRAINYARD_HOST="127.0.0.1",
            TRAINYARD_PORT=str(self.port),
            TRAINYARD_DEMO_MODEL="true",  # what `make run` sets unless told otherwise
        )
        env.update(variables)
        keys = variables.get("TRAINYARD_API_KEYS", "").split(",")
        # The server's first key, if it has keys: what a client of it sends.
        self.auth = {"Authorization": f"Bearer {keys[0].strip()}"} if keys[0].strip() else {}
        with self.log.open("ab") as log:
            log.write(f"\n==> trainyard serve with {variables}\n".encode())
            self.process = subprocess.Popen(
                [TRAINYARD, "serve"], env=env, stdout=log, stderr=subprocess.STDOUT
            )
        self._wait_until_ready(demo_served)

    def _wait_until_ready(self, demo_served: bool) -> None:
        """/readyz answers 200 and, if asked, the demo model is served: the tour's first
        command shows its endpoint, which the README says appears once the worker loaded it."""
        deadline = time.monotonic() + START_TIMEOUT
        with httpx.Client(
            base_url=f"http://127.0.0.1:{self.port}", headers=self.auth, timeout=5
        ) as client:
            while True:
                assert self.process is not None
                if self.process.poll() is not None:
                    raise AssertionError(f"trainyard serve exited:\n{self.tail()}")
                try:
                    ready = client.get("/readyz").status_code == 200
                    if ready and demo_served:
                        model = client.get("/v1/models/demo")
                        ready = model.status_code == 200 and bool(
                            model.json()["inference_base_url"]
                        )
                    if ready:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise AssertionError(f"trainyard serve never got ready:\n{self.tail()}")
                time.sleep(0.1)

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        self.process = None

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    live = Server(tmp_path / "var", tmp_path / "server.log")
    try:
        yield live
    finally:
        live.stop()


# --------------------------------------------------------------------------- running

CURL_FUNCTION = f"""\
set -o pipefail
curl() {{
  echo called >> "$TOUR_CALLS"
  command curl --max-time {CURL_MAX_SECONDS} --dump-header "$TOUR_HEADERS" "$@"
}}
"""


class Shell:
    """Runs tour commands one by one in bash, carrying the variables they assign."""

    def __init__(self, workdir: Path, server: Server) -> None:
        self.workdir = workdir
        self.server = server
        self.state = workdir.parent / "tour-variables.sh"
        self.state.write_text("")
        self.variables: list[str] = []

    def run(self, number: int, command: Command) -> None:
        where = f"README.md:{command.line}: `{command.text.splitlines()[0]}`"
        if make := MAKE_RUN.match(command.text.strip()):
            self.server.start(dict(word.split("=", 1) for word in shlex.split(make.group(1))))
            return
        if re.match(r"\s*(make|trainyard)\b", command.text):
            raise AssertionError(f"{where}: the test can only run `make run` of the CLI")
        assert command.curls <= 1, f"{where}: one curl per command, so its status is known"
        variable = ASSIGNMENT.match(command.text.strip())
        if variable and variable.group(1) not in self.variables:
            self.variables.append(variable.group(1))
        calls = self.workdir.parent / f"calls-{number}"
        headers = self.workdir.parent / f"headers-{number}"
        text = command.text.replace(README_ADDRESS, f"localhost:{self.server.port}")
        save = f'declare -p {" ".join(self.variables)} > "{self.state}"' if self.variables else ""
        script = (
            f'{CURL_FUNCTION}source "{self.state}"\n{text}\n'
            f'tour_status=$?\n{save}\nexit "$tour_status"\n'
        )
        env = {k: v for k, v in os.environ.items() if not k.upper().startswith("TRAINYARD_")}
        env.update(TOUR_CALLS=str(calls), TOUR_HEADERS=str(headers))
        try:
            done = subprocess.run(
                ["bash", "-c", script],
                cwd=self.workdir,
                env=env,
                capture_output=True,
                text=True,
                timeout=COMMAND_TIMEOUT,
            )
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"{where} ran over {COMMAND_TIMEOUT:.0f}s") from exc
        report = f"{where}\nexit {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
        assert done.returncode == 0, f"{report}\nserver log:\n{self.server.tail()}"
        if command.curls:
            called = calls.read_text().count("called") if calls.exists() else 0
            assert called == 1, f"{where}: curl ran {called} times, not once\n{report}"
            dumped = headers.read_text() if headers.exists() else ""
            statuses = [
                int(m.group(1)) for line in dumped.splitlines() if (m := STATUS_LINE.match(line))
            ]
            assert statuses, f"{where}: no HTTP response\n{report}"
            want = expected(command).status
            if want is None:
                assert 200 <= statuses[-1] < 300, f"{where}: HTTP {statuses[-1]}\n{report}"
            else:
                assert statuses[-1] == want, f"{where}: HTTP {statuses[-1]}, not {want}\n{report}"
        check_output(command, done.stdout)


# --------------------------------------------------------------------------- tests


@pytest.mark.slow
@pytest.mark.torch  # the tour's `demo` model is made and trained on the cpu backend
def test_every_curl_example_runs_against_a_live_server(tmp_path: Path, server: Server) -> None:
    for tool in ("bash", "curl", "jq"):
        assert shutil.which(tool), f"the README's API tour needs `{tool}` on PATH"
    commands = tour(README.read_text())
    assert sum(c.curls for c in commands) >= 20, "the tour lost its curl examples"
    workdir = tmp_path / "shell"
    workdir.mkdir()
    shell = Shell(workdir, server)
    server.start({}, demo_served=True)  # the reader's `make run` of the quick start
    for number, command in enumerate(commands):
        shell.run(number, command)


def test_no_curl_example_is_left_out_of_the_tour() -> None:
    text = README.read_text()
    blocks = fenced_blocks(text)
    for block in blocks:
        if block.language not in SHELL_LANGUAGES:
            assert not any(CURL.search(line) for line in block.lines), (
                f"README.md:{block.line}: a curl example in a ```{block.language} block, which "
                "the tour does not run; use ```sh"
            )
    in_tour = sum(c.curls for c in tour(text))
    in_blocks = sum(
        len(CURL.findall(line))
        for block in blocks
        if block.language in SHELL_LANGUAGES
        for line in block.lines
    )
    assert in_tour == in_blocks, "a curl sits in a comment or output line, where nothing runs it"
    prose = re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
    inline = [span for span in re.findall(r"`([^`\n]+)`", prose) if CURL.search(span)]
    assert not inline, f"curl examples in prose, which nothing runs: {inline}"


def test_make_run_is_what_the_tour_starts() -> None:
    recipe = MAKEFILE.read_text().split("\nrun:", 1)[1].split("\n\n", 1)[0]
    assert "TRAINYARD_DEMO_MODEL=$${TRAINYARD_DEMO_MODEL:-true} $(BIN)/trainyard serve" in recipe


def test_split_commands_joins_continuations_quotes_and_heredocs() -> None:
    block = Block(
        language="sh",
        line=10,
        lines=[
            "JOB=$(curl -s -X POST localhost:8000/x -H 'a: b' \\",
            """  -d '{"text": "it's", "n": 1,""",
            """  "m": 2}' | jq -r .id)   # the job's id""",
            "# job_…",
            "#  continued",
            "",
            "cat > body.json <<'EOF'",
            '{"a": "b c"}',
            "EOF",
            "curl -s localhost:8000/y",
        ],
    )
    with pytest.raises(ReadmeError):  # `it's` leaves a quote open
        split_commands(block)
    block.lines[1] = """  -d '{"text": "it is", "n": 1,"""
    commands = split_commands(block)
    assert [c.line for c in commands] == [11, 17, 20]
    assert commands[0].text.endswith("jq -r .id)   # the job's id")
    assert commands[0].output == ["job_…", " continued"]
    assert commands[1].text.splitlines()[-1] == "EOF" and commands[1].curls == 0
    assert commands[2].output == []
    with pytest.raises(ReadmeError):
        split_commands(Block(language="sh", line=1, lines=["# prose, not output", "curl -s x"]))
    console = Block(language="console", line=1, lines=["$ curl -s \\", "  x", '{"a": 1}'])
    assert [(c.text, c.output) for c in split_commands(console)] == [
        ("curl -s \\\n  x", ['{"a": 1}'])
    ]


def test_documented_output_patterns() -> None:
    pattern = parse_pattern(
        '{"id": "job_…", "n": 1, "ok": true, "v": …, "items": [{"a": 1, ...}, ...], ...}'
    )
    good = {"id": "job_9", "n": 1, "ok": True, "v": None, "items": [{"a": 1, "b": 2}, 3], "x": 0}
    assert mismatch(pattern, good) is None
    for broken in (
        {**good, "id": "run_9"},
        {**good, "n": 2},
        {**good, "ok": 1},
        {**good, "items": []},
        {k: v for k, v in good.items() if k != "v"},
    ):
        assert mismatch(pattern, broken) is not None, broken
    assert mismatch(parse_pattern("[1]"), [1, 2]) is not None
    command = Command("curl -si x", 1, ["HTTP/1.1 409 Conflict", "...", "x: …", "", '{"a": 1}'])
    assert expected(command).status == 409
    check_output(command, 'HTTP/1.1 409 Conflict\r\ny: 1\r\nx: 2\r\n\r\n{"a": 1, "b": 2}')
    with pytest.raises(AssertionError):
        check_output(command, 'HTTP/1.1 409 Conflict\r\n\r\n{"a": 1}')  # no `x:` line
    with pytest.raises(AssertionError):
        check_output(Command("curl x", 1, ["a", "b"]), "b\na\n")  # out of order


# --------------------------------------------------------------------------- configuration


def configuration_table() -> dict[str, str]:
    """`TRAINYARD_*` variable -> its default cell, from the README's Configuration table."""
    section = README.read_text().split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in rows[0].strip("|").split("|")]
    assert header == ["variable", "default", "meaning"], header
    table: dict[str, str] = {}
    for row in rows[2:]:
        cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
        assert len(cells) == 3, f"a Configuration row without three cells: {row}"
        variable = re.fullmatch(r"`([A-Z0-9_]+)`", cells[0])
        assert variable, f"the variable cell is not a `NAME`: {row}"
        assert variable.group(1) not in table, f"{variable.group(1)} is listed twice"
        table[variable.group(1)] = cells[1]
    return table


def documented_default(cell: str) -> str:
    """The value a default cell names: its first `code`, or "" for `(empty...`."""
    if cell.startswith("(empty"):
        return ""
    value = re.match(r"`([^`]*)`", cell)
    assert value, f"a default cell that names no value: {cell!r}"
    return value.group(1)


def test_configuration_table_lists_every_setting_with_its_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prefix = Settings.model_config.get("env_prefix")
    assert prefix == "TRAINYARD_"
    table = configuration_table()
    variables = {f"{prefix}{name.upper()}": name for name in Settings.model_fields}
    assert sorted(table) == sorted(variables), (
        f"missing: {sorted(set(variables) - set(table))}; "
        f"not settings: {sorted(set(table) - set(variables))}"
    )
    for key in list(os.environ):
        if key.upper().startswith("TRAINYARD_"):
            monkeypatch.delenv(key)
    defaults = Settings()
    for variable, cell in table.items():
        name = variables[variable]
        monkeypatch.setenv(variable, documented_default(cell))
        documented = getattr(Settings(), name)
        monkeypatch.delenv(variable)
        assert documented == getattr(defaults, name), (
            f"{variable}: the README says the default is {cell}; "
            f"it is {Settings.model_fields[name].get_default(call_default_factory=True)!r}"
        )
    make_run = re.search(r"\(`make run`: `([^`]*)`\)", table["TRAINYARD_DEMO_MODEL"])
    assert make_run, "the README no longer says what `make run` sets TRAINYARD_DEMO_MODEL to"
    assert f"TRAINYARD_DEMO_MODEL=$${{TRAINYARD_DEMO_MODEL:-{make_run.group(1)}}}" in (
        MAKEFILE.read_text()
    )
