"""cuflash's benchmark: ``cuflash-bench`` (``python -m cuflash.bench``).

Modules: :mod:`.cli` (arguments, tables, progress, --json / --csv / --plot), :mod:`.speed`,
:mod:`.memory`, :mod:`.io` (FLOP and byte counts, the IO table, ncu), :mod:`.sparse`, and
:mod:`.common` (device environment, inputs, timing, ceilings, footnotes, progress bar).

Importing the package or any module of it needs neither a GPU nor CuPy's CUDA libraries.
"""
