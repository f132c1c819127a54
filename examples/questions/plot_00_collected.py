"""
The questions readers ask, ranked
=================================

Which mixed-precision questions do readers keep asking? We collected them from issue threads
and pull requests of pytorch/pytorch, transformers, accelerate, Lightning, torchtitan, torchao,
TransformerEngine and their neighbours, and from the PyTorch forums, asked in 2024-2026,
grouped the threads that ask the same thing, and ranked the confusions by how many threads
ask them. The list is data shipped with the package (``mpguide/data/questions.json``, read by
:mod:`mpguide.questions`); each question links the threads and the section of this guide that
answers it, and says whether the answer is full, partial, or still missing.
"""

# %%
# Setup
# -----
from mpguide import questions

collected = questions.collected()
coverage = collected.coverage()
print(f"{len(collected.questions)} questions from {sum(q.count for q in collected.questions)} "
      f"threads: {coverage['full']} answered fully, {coverage['part']} in part, "
      f"{coverage['none']} not yet")

# %%
# The confusions that recur most
# ------------------------------
# Each group is one confusion; its size is the number of threads that ask it.
from mpguide.core.table import Table

sizes = questions.group_sizes(collected.questions)
Table(("confusion", "threads"), tuple(sizes.items())[:12],
      f"The 12 most asked of {len(sizes)} confusions")

# %%
assert len(collected.questions) >= 60
assert list(sizes.values()) == sorted(sizes.values(), reverse=True)

# %%
# Every question, ranked
# ----------------------
# Most recurring confusion first; the answer column links the section that answers it.
collected

# %%
# Answers by theme
# ----------------
# The pages of this section, one per theme, and how many of the collected questions each
# theme's answers cover (an answer on a chapter page counts for its theme too).
themes = Table(
    ("theme", "questions", "full", "part", "none"),
    tuple(
        (theme, len(qs), *(sum(q.coverage == c for q in qs) for c in questions.COVERAGE))
        for theme in questions.THEMES
        for qs in [[q for q in collected.questions if q.theme == theme]]
    ),
    "Coverage by theme",
)
themes

# %%
assert sum(r["questions"] for r in themes.records()) == len(collected.questions)

# %%
# What we saw
# -----------
# The totals above are computed from the data file at build time: adding a question or an
# answer changes them. A question without an answer is listed with ``none``: the note in the
# data file says why (most need a GPU, several GPUs, or a library the guide does not depend
# on).
