"""cuflash's benchmark: ``cuflash-bench`` (``python -m cuflash.bench``).

Modules: :mod:`.cli` (arguments, which tables run, progress), :mod:`.outputs` (--json / --csv /
--plot), :mod:`.speed` (with its :mod:`.backends`), :mod:`.memory`, :mod:`.io` (the IO table,
ncu) over :mod:`.counts` (FLOP and byte counts), :mod:`.sparse`, :mod:`.decode`, :mod:`.varlen`,
:mod:`.host`, :mod:`.e2e`, and :mod:`.common` (device environment, inputs, timing, ceilings,
footnotes, progress bar).

Importing the package or any module of it needs neither a GPU nor CuPy's CUDA libraries.
"""
