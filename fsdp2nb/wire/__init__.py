"""What the kernel and its ranks share: message types, signed framing over sockets, channels. No torch."""
