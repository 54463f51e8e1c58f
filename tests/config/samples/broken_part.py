value = 1 / 0
