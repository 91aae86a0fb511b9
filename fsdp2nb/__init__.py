"""fsdp2nb: persistent FSDP2 ranks behind a %%fsdp2 cell magic."""
