# rules for the download stage
