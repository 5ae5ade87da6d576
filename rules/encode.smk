# rules for the encode stage
