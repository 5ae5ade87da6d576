# rules for the pretrain stage
