"""Process lifecycle, the signed transport and the message types shared by kernel and ranks. No torch."""
