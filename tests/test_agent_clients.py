"""The real agent CLIs against a real `mlxlis serve`, set up exactly as docs/serving.md says:
Claude Code (npm `@anthropic-ai/claude-code`, the Messages API) and Codex (npm
`@openai/codex`, the Responses API), each asked one thing in its non-interactive mode on
Qwen2.5-Coder-0.5B (the smallest catalog model whose context holds their ~12 000-token
prompts).

What this proves: each client's own first requests — Claude Code's 32 000-token max_tokens
beside its long prompt, its system message inside `messages`; Codex's namespace tools — are
taken (no 4xx in the server's log), their streamed replies parse in the real client, and the
CLI ends with the model's answer and no error. It does not judge the answer.

The CLIs come from the npm registry into ~/.cache/mlxlis/agents (once); without npm on the
machine the test is skipped. Opt-in (MLXLIS_AGENT_CLIS=1 make test-all): on a 2-vCPU x86 CPU
(AMD EPYC, AVX-512) the 0.5B model's prefill of Claude Code's first prompt (11 665 tokens) took
over 10 minutes, and Claude Code cancels and retries at 10 (API_TIMEOUT_MS did not move it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import need_pulled
from serve_process import ServeProcess

pytestmark = [
    pytest.mark.extended,
    pytest.mark.skipif(
        os.environ.get("MLXLIS_AGENT_CLIS") != "1",
        reason="opt-in (MLXLIS_AGENT_CLIS=1): a cold 12 000-token prefill per client",
    ),
]

CLIENTS = {"@anthropic-ai/claude-code": "2.1.332", "@openai/codex": "0.171.0"}
MODEL = "qwen2.5-coder-0.5b"
ASK = "Reply with one word: hello."
RUN_S = 1800  # a hang guard: a cold prefill of ~12 000 tokens on a slow CPU


@pytest.fixture(scope="module")
def bins() -> Path:
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: the agent CLIs come from the npm registry")
    from mlxlis.loading import catalog

    home = catalog.store_dir().parent / "agents"
    wanted = [f"{name}@{version}" for name, version in CLIENTS.items()]
    stamp = home / "installed.json"
    if not stamp.is_file() or json.loads(stamp.read_text()) != wanted:
        home.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [npm, "install", "--prefix", str(home), "--no-audit", "--no-fund", *wanted],
            check=True,
            timeout=600,
        )
        stamp.write_text(json.dumps(wanted))
    return home / "node_modules" / ".bin"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    need_pulled(MODEL)
    srv = ServeProcess(tmp_path_factory.mktemp("agents"), "-m", MODEL, "--verbose")
    yield srv
    assert srv.stop() == 0, srv.log()


def refusals(srv: ServeProcess, skip: int) -> list[str]:
    lines = srv.log().splitlines()[skip:]
    return [x for x in lines if 'HTTP/1.1" 4' in x or " 400 " in x or "error" in x.lower()]


def run_cli(server: ServeProcess, cmd: list, cwd: Path, env: dict[str, str]) -> str:
    """The CLI's stdout once it exits 0 (else its output tails and the server's log)."""
    done = subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_S,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:], server.log()[-3000:])
    return done.stdout


def test_claude_code_answers(bins, server, tmp_path):
    seen = len(server.log().splitlines())
    env = {
        **os.environ,
        "HOME": str(tmp_path),  # its settings and session files: none of the user's
        "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{server.port}",
        "ANTHROPIC_AUTH_TOKEN": "unused",
        "ANTHROPIC_MODEL": MODEL,
        "ANTHROPIC_SMALL_FAST_MODEL": MODEL,
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    out = run_cli(
        server,
        [bins / "claude", "-p", ASK, "--max-turns", "1", "--output-format", "json"],
        tmp_path,
        env,
    )
    result = json.loads(out)
    assert result["is_error"] is False and result["result"].strip(), result
    assert "POST /v1/messages" in "\n".join(server.log().splitlines()[seen:])
    assert not refusals(server, seen), refusals(server, seen)


def test_codex_answers(bins, server, tmp_path):
    seen = len(server.log().splitlines())
    home = tmp_path / "codex"
    home.mkdir()
    # docs/serving.md's configuration (web search off: a hosted tool cannot run here: refused)
    (home / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "mlxlis"\nweb_search = "disabled"\n\n'
        "[model_providers.mlxlis]\n"
        'name = "mlxlis"\n'
        f'base_url = "http://127.0.0.1:{server.port}/v1"\n'
        'wire_api = "responses"\n'
    )
    env = {**os.environ, "HOME": str(tmp_path), "CODEX_HOME": str(home)}
    out = run_cli(
        server, [bins / "codex", "exec", "--skip-git-repo-check", "--json", ASK], tmp_path, env
    )
    events = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    kinds = [e.get("type") for e in events]
    assert "turn.completed" in kinds and "turn.failed" not in kinds and "error" not in kinds, kinds
    said = [
        e["item"].get("text", "")
        for e in events
        if e.get("type") == "item.completed" and e["item"].get("type") == "agent_message"
    ]
    assert any(s.strip() for s in said), events
    assert "POST /v1/responses" in "\n".join(server.log().splitlines()[seen:])
    assert not refusals(server, seen), refusals(server, seen)
