"""The base layer: the kit's conventions (kit: flags, errors, atomic files), ranks, run directories and tarballs (runs), the CPU lock writer (cpu_lock). Imports nothing of the kit's."""
