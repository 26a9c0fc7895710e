-- What a batch added to the job's counters, taken back (its bstats fields dropped).
local function zero_counts(stats, bstats, batch)
  for _, f in ipairs({'completed', 'failed', 'quarantined', 'truncated', 'output_tokens'}) do
    local k = batch .. '|' .. f
    local old = tonumber(redis.call('HGET', bstats, k) or '0')
    if old ~= 0 then redis.call('HINCRBY', stats, f, -old) end
    redis.call('HDEL', bstats, k)
  end
end
