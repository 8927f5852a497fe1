"""What peers and trainers publish in the DHT: stage records, trainer progress records and the sample
ledger that accounts for every microbatch by id."""
