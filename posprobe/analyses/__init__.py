"""One module per analysis: a frozen config, a run function, a result of tidy tables + meta.

Where a change lands (counted on the code):
- a new analysis: its module here (Config in `configs.py`, `run_x(model, data, config) -> Result`), its report page
  module in `posprobe/report/` (and its line in `report/pages.py`), its command in `posprobe/cli/` and its docs page;
- an atlas section, in the atlas of one model, of many, or both: 3 places in 3 files — its line in
  `configs.SECTIONS` (module, help, which atlases), its `AtlasSection` beside its analysis (`run` for one model,
  `compare` or `across` for many, `blocked`, headlines, paragraph) and its paragraph and side-by-side figure in its
  report module. `tests/test_atlas.py::test_a_section_declared_in_one_place_runs_and_reaches_the_page_and_meta`
  declares a dummy section in those places and finds it on both atlases' pages.
The zoo (`posprobe.zoo`) is below this package: analyses may read zoo folders (`zoo.folder`), never the reverse
(`tests/test_layers.py::test_the_zoo_imports_no_analysis`).
"""
