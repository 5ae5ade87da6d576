# rules for the shard stage
