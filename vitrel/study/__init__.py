"""The position-scheme study: the schemes on one recipe, several seeds, ViT and Swin, with intervals and verdicts.

    python bench/study.py --budget cpu              # 2 CPU cores, about 90 min -> bench/results/study_cpu.*
    python bench/study.py --budget gpu --jobs 8     # one GPU lease: every scheme and variant -> study_gpu.*
    python bench/study.py --budget smoke --schemes none,rel2d_full --out /tmp/study   # seconds (tests)
    python bench/extrapolation.py                   # = --budget extrapolation (zero-shot 1x-4x, and the curves)

(``python -m vitrel.study`` is the same command.) The one way to run the study, a layer over the training
framework: budget ``B``'s recipe is ``conf/experiment/study_B.yaml`` (shared parts in ``study_base.yaml``);
a run is ``python train.py experiment=study_B pos=<scheme> seed=<k> <study.archs.<arch>>`` (a
``study.variants`` label stands for a scheme with options, trained, or a *scored variant* ``{trained_as, score_with}``:
the trained weights of another entry rebuilt with call-time options), composed with Hydra's compose API and trained by
``vitrel.train.run.train``. The schemes default to every registered one (``vitrel.list_pos``) and the
variants, ordered by family. Fixed-canvas translation: every image is a 40x40 canvas, the 28x28 image at an
offset from the ``seen`` block in training; the trained model is scored on ``study.evals`` (the seen offsets,
the held-out ``unseen`` ones, whole-patch / sub-patch moves, the canvas resized 1.5x / 2x), then fine-tuned
at the larger size (``study.finetune``; the model ``conf/model/from_checkpoint.yaml``: ``vitrel.load_model``
of its last checkpoint) and scored again. Cost per run: parameters, training images/s, peak memory; once the
selection is complete, every model's throughput again, the models taking turns (``vitrel.bench.alternate``;
``--recost``: every model of the results file again, in one alternation).

Reading (``vitrel.stats``): mean and 95 % interval over seeds per cell, paired differences against ``none``
and ``ape``, and a verdict on each of ``study.claims`` (reproduced / contradicted / not resolved).

Written after every run: ``<out>/<name>.json`` (recipe, machine, runs, summary, claims), ``.csv``, ``.md``,
``.png`` (with ``study.scales``, also ``<name>_curves.png``: accuracy against the resolution factor) and
``<name>_pos.safetensors`` (the first seed's position parameters, for the notebooks). Rerunning skips
finished runs (claims and unused variants may change meanwhile); an interrupted run resumes from its last
checkpoint in ``<out>/<name>_work/``. A run that raises (it does not build, a non-finite loss, out of memory) is
recorded (``failed``: its one-line error, its traceback in ``<out>/<name>_failed/``) and the others go on; the command
then lists the failures and exits 1, and a rerun retries them. ``--jobs N`` runs N worker processes (``--shard i/N``),
each taking the next run no worker has taken, merged into the same files.

Modules: ``runs`` (a run's config, training, scores, fine-tune, throughput timing), ``reading`` (summary,
claims, report, files), ``plots`` (the study's pictures, also for notebook 03), ``cli`` (the command).
"""

from vitrel.study.cli import main, parse_args, select
from vitrel.study.reading import claims, markdown, scheme_key, summarise, write_results
from vitrel.study.runs import BUDGETS, compose, eval_sets, finetune_cfg, materialise, recipe, run_one

__all__ = ["BUDGETS", "claims", "compose", "eval_sets", "finetune_cfg", "main", "markdown", "materialise"]
__all__ += ["parse_args", "recipe", "run_one", "scheme_key", "select", "summarise", "write_results"]
