"""The MTP off vs on benchmark and the synthetic acceptance sweep (a lane's ``bench:``
section; the module docstring of `measure` tells the measurements). One module per
concern; import a name from the module that defines it."""
