"""mtplib's Python MTP loop side by side with upstream's own C++ loop, on the same files (the
module docstring of `measure` tells the three measurements). One module per concern; import
a name from the module that defines it."""
