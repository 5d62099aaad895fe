"""Experiments: one subpackage per experiment that spans several modules (`bench`,
`sidebyside`, `wan`, `projection`), one module for each that fits in one, and what they
share in `common`. Packages hand on no names: import a name from the module that defines
it."""
