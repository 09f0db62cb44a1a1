"""Every shell command the README and the docs pages show is run here, so the manual cannot rot.

The pages are README.md and every `docs/*.md`. Each line of a ```bash block runs, in order (the README's first, then
the docs pages' by name; a command shown on several pages runs once, where it first appears), in a fresh copy of the
project (with this interpreter as `PYTHON` and as `python` on the PATH, so nothing is installed). Lines whose comment
says they need hardware or a network CI lacks are skipped: `# needs a GPU`, `# needs a network`, `# needs two
machines`; `bash run_tests.sh` is what CI itself runs. A line that says `# needs the <name> extra` is skipped, with the
reason, where that optional extra is not installed. A pipeline whose left side the pages also show by themselves
(`bash run_training.sh --debug 2>&1 | grep CPU1:`) runs its right side on that command's output: the same run, not
trained again. Where a page says what a command prints, SAYS holds those lines and they are checked in its output.
The README's commands run in the default suite; those only the docs pages show are in the slow tier (CI runs both):
what each of them shows has its own test in the default suite.
The pages' relative links must lead to a file of the project (and a `#fragment` to one of that page's headings), and
each docs page opens with its title, one sentence of what it covers, and a link back to the README.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SKIP_MARKERS = ("# needs a GPU", "# needs a network", "# needs two machines")
NOT_HERE = ("bash run_tests.sh",)
EXTRA = re.compile(r"# needs the (\w+) extra")  # the extra's name is the module it installs
WARMUP_NOTE = ("training.warmup_steps 2 (preset 'debug') does not fit a 2-step run: shortened to 0 (10 % of the run); "
               "set training.warmup_steps to choose")
NAN_REHEARSAL = ("bash run_training.sh --debug --set debug.inject_nan_step=3 --set debug.inject_nan_rank=1 "
                 "--set debug.inject_nan_module=model.layers.1.mlp")
NAN_PRODUCTION = ("bash run_training.sh --debug --set debug.nan_localize=false --set debug.nan_dump=false "
                  "--set training.nan_recompute=true --set debug.inject_nan_step=7 --set debug.inject_nan_rank=1 "
                  "--set debug.inject_nan_module=model.layers.1.mlp")
SAYS = {
    # "Debug a run": the log names the first module whose output went non-finite and every NaN gradient, writes the
    # dumps, and both ranks skip the step and train on
    NAN_REHEARSAL: ["CPU1:NaN GRADIENT DETECTED [GPU 1]",
                    "CPU1:First non-finite forward output: model.layers.1.mlp (LlamaMLP)",
                    "CPU1:Debug tensors saved: .checkpoints/debug/nan_debug_step_3.pkl",
                    "CPU0:WARNING | non-finite step 3 skipped (GPU 1 local loss non-finite)", "step 10/10, final loss"],
    # "Debug a run", to the root: the step recomputed in the run is the model's numerics, and its replay (the run just
    # trained is the newest folder) names the module, with the run's losses before it and the batch's documents
    NAN_PRODUCTION: ["CPU0:WARNING | non-finite step 7 skipped (GPU 1 local loss non-finite)",
                     "CPU1:WARNING | [GPU 1] reproducible: the model's numerics at step 7",
                     "replay it with the NaN diagnostics on: bash run_training.sh --replay logs/"],
    'bash run_training.sh --replay "$(ls -td logs/*/ | head -1)" --step 7': [
        "from .checkpoints/step_000005 on 2 ranks", "CPU1:First non-finite forward output: model.layers.1.mlp (LlamaMLP)",
        "CPU1:INFO | [GPU 1] step 7's batch on this rank: 4 samples of", "CPU1:INFO | [GPU 1] step 7 rank 1 micro-batch 0"],
    # "Short trial runs": the supervisor's console and rank 0's banner both give the shortened warm-up
    "bash run_training.sh --debug --max-steps 2": [f"supervisor: {WARMUP_NOTE}", f"CPU0:INFO | {WARMUP_NOTE}",
                                                   "CPU1:INFO | [GPU 1] Step [1/2]", "step 2/2, final loss"],
}


def pages() -> list[Path]:
    """The pages whose commands run: the README, then the docs pages by name."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def documented_commands(shown_on: list[Path] | None = None) -> list[str]:
    """Every command of every page's ```bash blocks (or of the pages `shown_on`), in page order, each once."""
    commands: list[str] = []
    for page in shown_on or pages():
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S):
            for line in block.splitlines():
                line = line.strip()
                if line and not line.startswith("#") and not any(m in line for m in SKIP_MARKERS):
                    if not line.startswith(NOT_HERE) and line not in commands:
                        commands.append(line)
    return commands


def project_files() -> list[str]:
    """The checkout's files as git lists them: tracked, and untracked but not ignored. A copy of the files that is no
    git work tree (what a GPU machine gets) is walked instead, leaving out what `.gitignore` names."""
    if (ROOT / ".git").exists() and shutil.which("git"):
        return subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout.split()
    rules = [line.strip() for line in (ROOT / ".gitignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]

    def ignored(relative: str) -> bool:
        """As git decides for these rules: a rule with an inner slash matches from the root (a folder's match covers
        what is under it), one without matches a name at any depth; the last matching rule wins."""
        parts = relative.split("/")
        verdict = False
        for rule in rules:
            pattern = rule.removeprefix("!").strip("/")
            names = ["/".join(parts[:i + 1]) for i in range(len(parts))] if "/" in pattern else parts
            if any(fnmatch.fnmatchcase(name, pattern) for name in names):
                verdict = not rule.startswith("!")
        return verdict

    found = []
    for folder, dirs, names in os.walk(ROOT):
        here = Path(folder).relative_to(ROOT).as_posix()
        prefix = "" if here == "." else f"{here}/"
        dirs[:] = [d for d in dirs if not ignored(prefix + d)]
        found += [prefix + n for n in names if not ignored(prefix + n)]
    return found


def copy_project(dest: Path) -> None:
    for name in project_files():
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("project")
    copy_project(dest)
    return dest


@pytest.fixture(scope="module")
def outputs() -> dict[str, str]:
    """The output (stdout and stderr merged) of each command that has run: `A 2>&1 | B`, where `A` is a command the
    README shows by itself and has run already, feeds that output to `B` instead of training again."""
    return {}


def test_readme_shows_commands() -> None:
    assert "bash run_training.sh --debug" in documented_commands()
    assert SAYS.keys() <= set(documented_commands())


def without_code(text: str) -> str:
    """The page without its fenced blocks and inline code: what is left is prose, headings and links."""
    return re.sub(r"`[^`]*`", "", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M))


def anchors(page: Path) -> set[str]:
    """The `#fragment`s a page's headings get, as GitHub makes them: lower case, punctuation dropped, spaces to '-'."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.replace("`", "").strip().lower()).replace(" ", "-") for h in headings}


def test_readme_and_docs_links_lead_somewhere() -> None:
    broken = []
    for page in pages():
        for target in re.findall(r"\]\(([^)\s]+)\)", without_code(page.read_text())):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, fragment = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.is_relative_to(ROOT) or not linked.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif fragment and (linked.suffix != ".md" or fragment not in anchors(linked)):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_each_docs_page_opens_with_its_title_and_a_link_back_and_the_readme_links_it() -> None:
    docs = pages()[1:]
    assert docs, "no docs/*.md pages"
    readme = (ROOT / "README.md").read_text()
    for page in docs:
        title, blank, *rest = page.read_text().split("\n")
        opening = "\n".join(rest).split("\n\n")[0]
        assert title.startswith("# ") and blank == "" and opening.strip(), f"{page.name}: a title, then one sentence"
        assert "](../README.md)" in opening, f"{page.name}: its opening does not link back to the README"
        assert f"](docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"


def command_params() -> list[object]:
    """The documented commands as test parameters: the README's as they are, the rest in the slow tier."""
    readme = set(documented_commands([ROOT / "README.md"]))
    return [command if command in readme else pytest.param(command, marks=pytest.mark.slow)
            for command in documented_commands()]


@pytest.mark.parametrize("command", command_params())
def test_readme_command_runs(command: str, project: Path, outputs: dict[str, str]) -> None:
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])  # `python` = this interpreter
    env = {**os.environ, "PYTHON": sys.executable, "PATH": path}
    env.pop("VIRTUAL_ENV", None)
    if "SUPERVISOR_FAKE_GPUS=" in command:  # the pretended GPUs, not the "no GPU" the default tier runs with
        env.pop("CUDA_VISIBLE_DEVICES", None)
    extra = EXTRA.search(command)
    if extra and importlib.util.find_spec(extra.group(1)) is None:
        pytest.skip(f"the {extra.group(1)} extra is not installed: pip install -e '.[{extra.group(1)}]'")
    producer, pipe, consumer = command.partition(" 2>&1 | ")
    if pipe and producer in outputs:
        shell, stdin = consumer, outputs[producer]
    else:
        shell, stdin = f"{{ {command}\n}} 2>&1", None  # a line break: the command may end in a comment
    out = subprocess.run(["bash", "-c", shell], cwd=project, env=env, input=stdin, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, f"`{shell}` exited {out.returncode}:\n{out.stdout[-6000:]}"
    assert [line for line in SAYS.get(command, []) if line not in out.stdout] == [], out.stdout[-6000:]
    outputs[command] = out.stdout
