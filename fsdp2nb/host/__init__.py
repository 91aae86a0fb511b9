"""Torch-free helpers for the processes of one host, used on both sides of the wire: which process a
pid names, a poll() woken when one ends, SIGINT held off around code that must not be cut, the ranks'
log files, and the in-memory snapshot store with its persisting mark."""
