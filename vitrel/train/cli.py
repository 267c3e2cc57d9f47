"""Console entry points (``vitrel-train``, ``vitrel-eval``, ``vitrel-predict``): ``train.py`` / ``eval.py`` /
``predict.py`` with the repository conf/, also for a launcher that first imports a module of its own (a position
scheme registered outside the package); and
:func:`with_override_hints`, which adds to Hydra's refusal of an override what to set instead: the position scheme's
options for an unknown ``pos.<key>=``, the new key for one of vitrel 0.1's (``optim.lr=``), the nearest option of a
config group for one it lacks (``pos=rel2d_ful``), the override without ``+`` of a group the defaults already hold
(``+experiment=fmnist_quick``)."""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "train_main",
    "eval_main",
    "predict_main",
    "predict_task",
    "conf_dir",
    "pos_option_hint",
    "moved_key_hint",
    "group_option_hint",
    "added_group_hint",
    "with_override_hints",
]


def conf_dir() -> str:
    """The ``conf/`` folder next to the ``vitrel`` package (a source checkout or an editable install)."""
    d = Path(__file__).resolve().parents[2] / "conf"
    if not (d / "train.yaml").exists():
        raise FileNotFoundError(
            f"no Hydra configs at {d}: the console scripts need a source checkout (pip install -e .); "
            "otherwise run train.py from the repository"
        )
    return str(d)


def pos_option_hint(args: Sequence[str], config_name: str = "train") -> str | None:
    """What to set instead of a ``pos.<key>=<value>`` override (no ``+``) of a key the composed ``pos`` node lacks,
    which Hydra refuses (``Key '<key>' is not in struct``) without naming the scheme's options: the scheme's options,
    or the ``+pos.<key>=`` to add an option its ``conf/pos`` file does not set. None when no such override is in
    ``args`` (a command line's overrides) or the rest of them does not compose (a sweep's ``pos=a,b``, another
    error: Hydra's message stands alone)."""
    bad = [a for a in args if re.match(r"pos\.[A-Za-z_]\w*=", a)]
    if not bad:
        return None
    try:
        from hydra import compose, initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra

        import vitrel.config  # noqa: F401  (the schemas conf/ names)
        from vitrel.pos.registry import get_pos_class, scheme_options

        rest = [a for a in args if "=" in a and not a.startswith("-") and a not in bad]
        GlobalHydra.instance().clear()
        with initialize_config_dir(conf_dir(), version_base="1.3"):
            pos = compose(config_name, overrides=rest).pos
        name = str(pos.name)
        options = sorted(scheme_options(get_pos_class(name)))
    except Exception:  # noqa: BLE001  (no hint: Hydra's own error is the answer)
        return None
    lines = []
    for a in bad:
        key, value = a.split("=", 1)[0].split(".", 1)[1], a.split("=", 1)[1]
        if key in pos:
            continue
        if key in options:
            lines.append(f"{a}: {name}'s conf/pos file does not set {key}; add it with +pos.{key}={value}")
        else:
            lines.append(f"{a}: position scheme {name!r} has no option {key!r}; its options: {', '.join(options)}")
    return "\n".join(lines) or None


def moved_key_hint(args: Sequence[str]) -> str | None:
    """The new key of each of vitrel 0.1's keys set without ``+`` in ``args`` (``optim.lr=1e-3``, ``compile=true``),
    and vitrel's key for each of lightning-hydra-template's (``model.optimizer.lr=1e-3``, ``data.data_dir=...``):
    Hydra refuses those at composition (``Key 'optim' not in 'TrainConfig'``), before
    :func:`~vitrel.config.check_moved_keys` can name the new key. With ``+`` they compose and that check names it.
    None when ``args`` sets none."""
    from vitrel.config import MOVED_KEYS, template_key

    lines = []
    for a in args:
        m = re.match(r"([A-Za-z_][\w.]*)=", a)
        if not m:
            continue
        key = m.group(1)
        if key in MOVED_KEYS:
            lines.append(f"{a}: {key} moved to {MOVED_KEYS[key]}")
        elif template_key(key):
            lines.append(f"{a}: {key} (lightning-hydra-template's) is {template_key(key)} in vitrel")
        elif key == "optim" or key.startswith("optim."):
            lines.append(f"{a}: {key} moved to module.optimizer / module.scheduler")
    return "\n".join(lines) or None


def key_typo_hint(args: Sequence[str], config_name: str = "train", conf: str | Path | None = None) -> str | None:
    """The nearest keys for each ``<key>=<value>`` / ``<node>.<key>=<value>`` override (no ``+``) naming a key the typed
    schemas lack (``trainer.max_epoch=1``, ``epochs=3``), which Hydra refuses (``Key 'max_epoch' not in
    'TrainerConfig'``): among the script's top level, ``trainer`` (Lightning's ``Trainer`` arguments), ``module``
    (its optimizer's and scheduler's too) and ``data`` (the keys of every data schema); a top-level key is looked for
    in all of them (``lr`` -> ``module.optimizer.lr``). None when each key is there or none is near; config groups
    (``pos=...``) are :func:`group_option_hint`'s."""
    from vitrel import config as c

    top = {"train": c.TrainConfig, "eval": c.EvalConfig, "predict": c.PredictConfig}.get(config_name)
    if top is None:
        return None
    root = Path(conf or conf_dir())
    data = {k for cls in (c.DataConfig, *c.DataConfig.__subclasses__()) for k in c.schema_keys(cls, "data.")}
    nodes = {"trainer": c.schema_keys(c.TrainerConfig, "trainer."), "module": c.schema_keys(c.ModuleConfig, "module.")}
    nodes = {n: [k for k in keys if "._" not in k] for n, keys in {**nodes, "data": sorted(data)}.items()}
    own = c.schema_keys(top)
    lines = []
    for a in args:
        m = re.match(r"([A-Za-z_][\w.]*)=", a)  # (not +key=, ++key=, ~key: those add, force or delete)
        if not m or m.group(1).startswith("hydra") or (root / m.group(1)).is_dir():
            continue
        *node, key = m.group(1).split(".")
        if not node:  # (the top level's own keys first, then the nodes')
            nested = [k for n in nodes if n in own for k in nodes[n]]
            near, where = c.nearest_keys(key, own) or c.nearest_keys(key, nested), f"{config_name}.py's config"
        elif len(node) == 1 and node[0] in nodes and node[0] in own:
            near, where = c.nearest_keys(key, nodes[node[0]]), node[0]
        else:
            continue
        if near and m.group(1) not in near:  # (a key that is there is its own nearest)
            lines.append(f"{a}: {where} has no {key}; did you mean " + " or ".join(near) + "?")
    return "\n".join(lines) or None


def group_option_hint(args: Sequence[str], conf: str | Path | None = None) -> str | None:
    """The nearest options of a config group for each ``<group>=<option>`` override (``pos=rel2d_ful``,
    ``module/mixup=naflx``; each value of a sweep's list or of ``logger=[csv,wandb]``) naming an option
    ``conf/<group>/`` lacks, which Hydra refuses ("Could not find 'pos/rel2d_ful'") above its list of every option.
    None when each option is there or none is near, or ``args`` add a ``hydra.searchpath`` (options this folder does
    not hold)."""
    import difflib

    from vitrel.pos import get_pos_class, list_pos

    root = Path(conf or conf_dir())
    if any(a.lstrip("+").startswith("hydra.searchpath") for a in args):
        return None
    lines = []
    for a in args:
        m = re.fullmatch(r"\+?([A-Za-z_][\w/]*)=\[?([\w.,-]+)\]?", a)  # (an option, a sweep's or a group's list)
        if not m or m.group(1).startswith("hydra") or not (root / m.group(1)).is_dir():
            continue
        group = m.group(1)
        have = sorted(f.stem for f in (root / group).glob("*.yaml"))
        for option in m.group(2).split(","):
            if option in have or option == "null":
                continue
            if group == "pos" and option in list_pos():  # (registered by the launcher's module: no config file)
                where = get_pos_class(option).__module__
                lines.append(
                    f"pos={option}: the scheme is registered (by {where}) but conf/pos has no {option}.yaml: put one "
                    f"(name: {option} and its options) in a folder of your own and add 'hydra.searchpath=[file://"
                    "<that folder>]' (docs/schemes.md: Adding a position scheme)"
                )
                continue
            near = difflib.get_close_matches(option, have, n=3, cutoff=0.6)
            if near:
                said = " or ".join(f"{group}={n}" for n in near)
                lines.append(f"{group}={option}: conf/{group} has no {option}.yaml; did you mean {said}?")
    return "\n".join(lines) or None


def added_group_hint(args: Sequence[str], config_name: str = "train", conf: str | Path | None = None) -> str | None:
    """The override without ``+`` for each ``+<group>=<option>`` (``+experiment=fmnist_quick``, Hydra's docs' way of
    choosing an experiment) of a group the config's defaults list already holds (``conf/train.yaml``'s ``experiment:
    null``), which Hydra refuses with advice for a defaults list, not for the command line ("Multiple values for
    experiment. To override a value use 'override experiment: fmnist_quick'"). None when ``args`` add no such group of
    options it has (a missing one is :func:`group_option_hint`'s) or the rest of them does not compose (another
    error: Hydra's message stands alone)."""
    root = Path(conf or conf_dir())
    added = {}
    for a in args:
        m = re.fullmatch(r"\+([A-Za-z_][\w/]*)=([\w.,-]+)", a)  # (not ++: Hydra refuses to force-add a group itself)
        if not m or m.group(1).startswith("hydra") or not (root / m.group(1)).is_dir():
            continue
        if all((root / m.group(1) / f"{o}.yaml").is_file() for o in m.group(2).split(",")):
            added[a] = m.group(1)
    if not added:
        return None
    try:
        from hydra import compose, initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra

        import vitrel.config  # noqa: F401  (the schemas conf/ names)

        rest = []  # the groups the defaults hold follow the groups chosen (an experiment's); a sweep's first option
        for a in args:
            m = re.fullmatch(r"([A-Za-z_][\w/]*)=([\w.,-]+)", a)
            if m and (root / m.group(1)).is_dir():
                rest.append(a.split(",")[0])
        GlobalHydra.instance().clear()
        with initialize_config_dir(str(root), version_base="1.3"):
            choices = compose(config_name, overrides=rest, return_hydra_config=True).hydra.runtime.choices
    except Exception:  # noqa: BLE001  (no hint: Hydra's own error is the answer)
        return None
    lines = []
    for a, group in added.items():
        if group in choices:
            now = choices[group] if choices[group] is not None else "none chosen"
            lines.append(f"{a}: {config_name}.yaml's defaults already hold {group} ({now}); choose it without the +: "
                         f"{a[1:]}")  # fmt: skip
    return "\n".join(lines) or None


def with_override_hints(main: Callable[[], Any], script: str, config_name: str = "train") -> Any:
    """``main()`` (a ``hydra.main`` function); when Hydra exits with an error, what to set instead after it, one
    ``<script>: <hint>`` line each: :func:`moved_key_hint`, :func:`pos_option_hint`, :func:`group_option_hint`,
    :func:`added_group_hint` and :func:`key_typo_hint` of the command line. Hydra's strictness stays: the run is
    refused as before."""
    try:
        return main()
    except SystemExit as e:
        if e.code == 1:
            args = sys.argv[1:]
            hints = [moved_key_hint(args), pos_option_hint(args, config_name), group_option_hint(args)]
            hints.append(added_group_hint(args, config_name))
            hints.append(key_typo_hint(args, config_name))
            hints = [h for h in hints if h]
            if hints:
                print("\n".join(f"{script}: {h}" for h in "\n".join(hints).splitlines()), file=sys.stderr, flush=True)
        raise


def _one_line(task: Callable[[Any], Any], script: str) -> Callable[[Any], Any]:
    """``task`` under :func:`~vitrel.train.user_errors.one_line_errors` (``functools.wraps``: Hydra sees ``task``)."""
    from vitrel.train.user_errors import one_line_errors

    @functools.wraps(task)
    def run(cfg: Any) -> Any:
        with one_line_errors(script):
            return task(cfg)

    return run


def train_main() -> None:
    import hydra

    import vitrel.config  # noqa: F401  (registers the config schemas conf/ names, before Hydra composes)
    from vitrel.train.run import train
    from vitrel.train.utils import quiet_third_party

    quiet_third_party()
    main = hydra.main(version_base="1.3", config_path=conf_dir(), config_name="train")(_one_line(train, "vitrel-train"))
    with_override_hints(main, "vitrel-train")


def eval_main() -> None:
    import hydra

    import vitrel.config  # noqa: F401
    from vitrel.train.evaluate import evaluate
    from vitrel.train.utils import quiet_third_party

    quiet_third_party()
    run = _one_line(evaluate, "vitrel-eval")
    main = hydra.main(version_base="1.3", config_path=conf_dir(), config_name="eval")(run)
    with_override_hints(main, "vitrel-eval", "eval")


def predict_task(script: str) -> Callable[[Any], Any]:
    """``run_predict`` with its refusals as one line ``<script>: <reason>`` (exit 1): a damaged, foreign or missing
    model file, an input that is no folder of images (or videos), a GPU this machine does not have, a setting it
    cannot honour (``topk=0``, ``seq_len`` for a video model...), image files none of which could be read, a key it
    does not read (``+top_k=3``)."""
    from vitrel.config import ConfigError
    from vitrel.inference import PredictSettingsError
    from vitrel.models.checkpoint import CheckpointError
    from vitrel.train.predict import NothingReadError, run_predict
    from vitrel.train.utils import AcceleratorUnavailableError

    refusals = (CheckpointError, FileNotFoundError, NotADirectoryError, AcceleratorUnavailableError, NothingReadError)
    refusals += (ConfigError,)

    @functools.wraps(run_predict)
    def run(cfg: Any) -> Any:
        try:
            return run_predict(cfg)
        except (*refusals, PredictSettingsError) as e:
            raise SystemExit(f"{script}: {e}") from None

    return run


def predict_main() -> None:
    import hydra

    import vitrel.config  # noqa: F401
    from vitrel.train.utils import quiet_third_party

    quiet_third_party()
    hydra.main(version_base="1.3", config_path=conf_dir(), config_name="predict")(predict_task("vitrel-predict"))()
