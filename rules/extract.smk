# rules for the extract stage
