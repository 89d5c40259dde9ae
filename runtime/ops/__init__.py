"""One module per op family: validation, planning and launching."""
