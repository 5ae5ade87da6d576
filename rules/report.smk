# rules for the report stage
