# rules for the squad stage
