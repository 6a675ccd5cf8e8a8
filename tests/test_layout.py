"""The kit's module layout: helpers sit below the scripts that use them (no import cycles), and what
imports train_dpo.py uses it as the training run, not as a library."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODULES = {p.stem: p for p in ROOT.glob("*.py")} | {"bench": ROOT / "bench" / "bench.py"}
TRAINING_RUN = {"TrainConfig", "run", "main", "exit_code", "__doc__"}  # what callers of a training may use


def kit_imports(path: Path) -> set[str]:
    """The kit's modules that path imports, at the top or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found & (set(MODULES) - {path.stem})


def test_no_import_cycles_among_the_kit_modules():
    graph = {name: kit_imports(path) for name, path in MODULES.items()}
    assert graph["kit"] == set() and "train_dpo" in graph["entrypoint"]  # the walk sees both kinds of import
    state = {}

    def visit(name, trail):
        if state.get(name) == "done":
            return
        assert state.get(name) != "open", f"import cycle: {' -> '.join(trail + [name])}"
        state[name] = "open"
        for dep in sorted(graph[name]):
            visit(dep, trail + [name])
        state[name] = "done"

    for name in sorted(graph):
        visit(name, [])


def test_train_dpo_is_imported_only_as_the_training_run():
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Name) and n.value.id == "train_dpo"}
        assert used <= TRAINING_RUN, f"{name}.py uses train_dpo.{', '.join(sorted(used - TRAINING_RUN))}"
        assert not any(isinstance(n, ast.ImportFrom) and n.module == "train_dpo" for n in ast.walk(tree)), name


def test_train_dpo_stays_a_recipe_and_each_methods_options_live_with_the_method():
    # Under 700 lines: a new method's options go in methods.py (DPOOptions, KTOOptions, GRPOOptions) and the fast
    # path's switches in fastpath.py, and TrainConfig inherits them
    assert len((ROOT / "train_dpo.py").read_text().splitlines()) < 700
    tree = ast.parse((ROOT / "train_dpo.py").read_text())
    config = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "TrainConfig")
    bases = {ast.unparse(b) for b in config.bases}
    assert {"methods.DPOOptions", "methods.KTOOptions", "methods.GRPOOptions", "fastpath.FastOptions"} <= bases
    own = {n.target.id for n in config.body if isinstance(n, ast.AnnAssign)}
    assert not own & {"loss_type", "sft_weight", "num_generations", "desirable_weight", "fused_ops"}


def test_the_image_converts_the_bundled_model_with_only_the_modules_it_copies_first(tmp_path):
    """The Dockerfile copies a few modules before converting the bundled model (so editing the others does
    not redo that step), which then runs with those alone: what they import, and what the conversion
    imports inside its function, must be among them."""
    import subprocess
    import sys

    lines = (ROOT / "Dockerfile").read_text().splitlines()
    step = next(i for i, line in enumerate(lines) if line.startswith("RUN ") and "python entrypoint.py model" in line)
    early = next(lines[i] for i in range(step - 1, -1, -1) if lines[i].startswith("COPY ")).split()[1:-1]
    assert {"entrypoint.py", "models.py"} <= set(early)
    for name in early:
        (tmp_path / name).write_text((ROOT / name).read_text())
    names = [name.removesuffix(".py") for name in early]
    done = subprocess.run([sys.executable, "-c", f"import {', '.join(names)}"], cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    tree = ast.parse((ROOT / "models.py").read_text())
    convert = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "export_bundled_model")
    inside = {a.name.split(".")[0] for n in ast.walk(convert) if isinstance(n, ast.Import) for a in n.names}
    assert inside & set(MODULES) <= set(names)


def markdown_links(path: Path) -> list[tuple[str, str]]:
    """(target file, anchor) of every relative link in a Markdown file (web links and pure anchors left out)."""
    links = re.findall(r"\]\(([^)\s]+)\)", path.read_text())
    return [tuple((t.split("#", 1) + [""])[:2]) for t in links if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for a Markdown file's headings: lower case, punctuation dropped, spaces to hyphens."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"(?m)^#+ (.*)$", path.read_text())}


def test_readme_is_a_first_page_and_every_link_in_it_and_docs_resolves():
    readme = ROOT / "README.md"
    assert readme.stat().st_size < 15_000  # the first page; reference material lives in docs/
    first = readme.read_text().split("\n## ")[0]
    assert first.index("make train") < first.index("make test")  # the two commands open it
    pages = [readme, *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]
    linked = {(readme.parent / target).resolve() for target, _ in markdown_links(readme)}
    assert set(sorted((ROOT / "docs").glob("*.md"))) <= linked  # every docs page is reachable from the README
    for page in pages:
        for target, anchor in markdown_links(page):
            dest = (page.parent / target).resolve()
            assert dest.exists(), f"{page.relative_to(ROOT)}: link to missing {target}"
            if anchor:
                assert anchor in anchors(dest), f"{page.relative_to(ROOT)}: no heading #{anchor} in {target}"


def test_the_image_ships_on_cudas_base_tag_from_a_separate_build_stage():
    """Two stages: pip and the model's conversion in `build`; the shipped stage installs no Python packages,
    brings Triton's C toolchain, and copies the venv and the model from `build`. CUDA's `base` tag, since
    torch's nvidia-* wheels carry the libraries that the `runtime` tag would ship a second time."""
    text = (ROOT / "Dockerfile").read_text()
    base = re.search(r"^ARG BASE_IMAGE=(\S+)", text, re.MULTILINE)[1]
    assert re.match(r"nvidia/cuda:[\d.]+-base-ubuntu22\.04(@sha256:[0-9a-f]{64})?$", base), base
    stages = re.split(r"^FROM ", text, flags=re.MULTILINE)[1:]
    assert len(stages) == 2 and stages[0].startswith("${BASE_IMAGE} AS build")
    shipped = stages[1]
    run_lines = " ".join(re.findall(r"^RUN ((?:.*\\\n)*.*)", shipped, re.MULTILINE))
    assert "pip install" not in run_lines and "apt-get install" in run_lines
    assert {"gcc", "libc6-dev", "python3-dev", "bubblewrap"} <= set(run_lines.split())
    assert "COPY --from=build /opt/venv /opt/venv" in shipped and "COPY --from=build /opt/kit/models" in shipped
    assert 'LABEL dpo-kit="1"' in stages[0] and 'LABEL dpo-kit="1"' in shipped  # make prune finds both stages' images


def test_every_python_file_compiles_without_a_warning():
    """An invalid escape such as '\\.' in a plain string is a SyntaxWarning on Python 3.12 (the GPU machine printed
    one for checker.py) and is to become an error; the image and CI run 3.10 and 3.11, which stay silent."""
    import warnings

    files = [p for p in ROOT.rglob("*.py") if not any(part.startswith(".") or part in {"models", "artifacts", "build"}
                                                      for part in p.relative_to(ROOT).parts)]
    assert len(files) > 30
    for path in files:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            compile(path.read_text(), str(path), "exec")  # raises SyntaxError (warning as error) naming the file
