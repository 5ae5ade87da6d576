# rules for the format stage
