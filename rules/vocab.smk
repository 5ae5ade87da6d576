# rules for the vocab stage
