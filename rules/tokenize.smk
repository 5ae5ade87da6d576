# rules for the tokenize stage
