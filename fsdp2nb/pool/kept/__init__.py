"""Kept pools (`%fsdp2 start --keep`), every side of them: the directory they share, the kernel that
holds one, `%fsdp2 pools`, a pool across Ray hosts, and the agent and ranks that outlive their
kernel. No torch; the kernel side (pool/) and the ranks' hosts (worker/) both import it."""
